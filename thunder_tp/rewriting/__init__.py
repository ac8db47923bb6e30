"""The rewrite: which collective goes where. reshard.py prices and performs a change of layout, communication.py
derives what a propagated program communicates, program.py re-runs every op on local pieces with those collectives."""
