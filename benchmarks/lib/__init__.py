"""What the benchmarks share: setup, models, modes, timing, gates and reports."""
