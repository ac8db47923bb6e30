"""gloo's alpha-beta on this machine, per collective kind: the table of ``benchmarks/lib/gloo_link.py``'s
measurement (how it is measured: that module's docstring).

    torchrun --nproc-per-node 2 -m benchmarks.projection.gloo_link      # prints the table
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from benchmarks.lib.gloo_link import measure_link
from benchmarks.lib.harness import pin_to_core


def main() -> None:
    pin_to_core()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    link = measure_link()
    if dist.get_rank() == 0:
        print(link.table())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
