"""Serving a trained draft: the draft-target checks, the speculative server flags, `eagle-tap eval-served`."""
