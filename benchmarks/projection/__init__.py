"""A step on N GPUs projected from one rank (alpha-beta), the link measured on gloo, and the check against gloo."""
