"""What exists to run the whole pipeline on one CPU machine (tests, CI, the demo, the benchmarks): the bundled
tiny target and its builder, the CPU stand-ins SGLang's processes import in place of GPU-only packages, and
launchers of a collector and an S3 server as child processes."""
