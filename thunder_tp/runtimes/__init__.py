"""What runs around a compiled program: the decode step (bound, compiled whole, CUDA graphs), generation's loops,
and the ranks' agreement checks (a compile that failed on one rank, inputs that differ among the TP group)."""
