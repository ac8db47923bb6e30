"""The rewrite: which collective goes where. communication.py derives what a propagated program communicates (the
redistributions of collectives/reshard.py it implies), program.py re-runs every op on local pieces with them."""
