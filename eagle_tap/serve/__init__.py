"""Serving with SGLang: the launcher (`eagle-tap serve`, CPU or GPU) and its HTTP helpers, the speculative flags
of a draft, swapping a draft into a running replica in place, and `eagle-tap eval-served`."""
