"""EAGLE-3 draft trainer: vocab mapping, draft model, training, evaluation and export."""
