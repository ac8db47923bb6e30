"""thunder_tp: tensor parallelism for Lightning Thunder."""
