"""Shortcuts through Thunder's tracing, each exact: a model's repeated blocks traced once (`repeated_blocks`: the
first block of each kind interpreted, the others replayed, their calls told apart by `block_keys`), and fusion
regions of one canonical form compiled once (`region_cache`)."""
