"""thunder_tp's own symbols that are no collective: the cross-entropy's (cross_entropy.py)."""
