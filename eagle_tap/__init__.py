"""eagle-tap: the command line, the CPU SGLang harness and the tiny target model used by tests and the demo."""

__version__ = "0.1.0"
