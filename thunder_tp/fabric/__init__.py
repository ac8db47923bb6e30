"""Lightning Fabric for thunder_tp: `from thunder_tp.fabric import ThunderTPStrategy`."""

from thunder_tp.fabric.strategy import ThunderTPStrategy

__all__ = ["ThunderTPStrategy"]
