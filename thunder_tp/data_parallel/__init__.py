"""TP inside data parallelism: 2-D meshes (mesh.py) and the checks that TP composes with Thunder's DDP / FSDP
transforms (composition.py)."""
