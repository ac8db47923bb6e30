"""Tools around the pipeline: N ranks simulated in one process (simulate), one rank of N alone (one_rank), trace
dumps and collective tables (debug), the whole model's gradient norm (clipping)."""
