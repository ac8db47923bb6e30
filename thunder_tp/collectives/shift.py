"""A cyclic shift over the TP group: rank r sends its tensor to rank r + step and receives rank r - step's.

The piece by which a decomposed all_gather or reduce_scatter moves (``execution/overlap.py``): one peer's chunk at a
time, each issued asynchronously (``batch_isend_irecv``: one NCCL group, so a ring of sends cannot deadlock) and
waited for just before the matmul that needs it. Its grad is the opposite shift. In a fake group (``one_rank``)
nothing arrives, so a rank receives its own tensor: shapes, bytes and compute are a real rank's, values finite.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from thunder.core.prims import get_grad, put_grad
from thunder.core.proxies import FutureTensorProxy, TensorProxy
from thunder.core.transforms import register_grad

from thunder_tp.collectives.distributed import name_work
from thunder_tp.collectives.lowering import _synchronous
from thunder_tp.collectives.symbols import comm_executor


class _AllWorks:
    """Several work handles waited for as one."""

    def __init__(self, works: list):
        self.works = works

    def wait(self, timeout=None) -> bool:
        """Wait for every handle."""
        for work in self.works:
            work.wait() if timeout is None else work.wait(timeout)
        return True


def shift_start(a: torch.Tensor, step: int, group: dist.ProcessGroup) -> tuple:
    """Issue the shift of ``a`` by ``step`` ranks: Thunder's (work, result) future."""
    size, rank = group.size(), dist.get_rank(group)
    a = a.contiguous()
    if dist.get_backend(group) == "fake":  # no peer: keep this rank's values (finite), the ops still issued
        received = a.clone()
    else:
        received = torch.empty_like(a)
    ops = [dist.P2POp(dist.isend, a, dist.get_global_rank(group, (rank + step) % size), group),
           dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (rank - step) % size), group)]
    return name_work((_AllWorks(dist.batch_isend_irecv(ops)), received), "send_recv", a, group)


def shift(a: torch.Tensor, step: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Rank r's result: rank r - step's ``a`` (synchronous)."""
    work, received = shift_start(a, step, group)
    work.wait()
    return received


def _shift_meta(a: TensorProxy, step: int, group: dist.ProcessGroup) -> TensorProxy:
    return TensorProxy(like=a)


tp_shift = comm_executor.register_operator("tp_shift", meta=_shift_meta, fn=shift)
tp_shift_start = comm_executor.register_operator(
    "tp_shift_start", meta=lambda a, step, group: FutureTensorProxy(like=a), fn=shift_start
)


def _shift_grad(a: TensorProxy, step: int, group: dist.ProcessGroup) -> TensorProxy:
    out = tp_shift(a, step, group)
    put_grad(a, tp_shift(get_grad(out), (-step) % group.size(), group))
    return out


def _async_shift(a: TensorProxy, step: int, group: dist.ProcessGroup) -> TensorProxy:
    from thunder.executors.torchex import wait_prim_impl

    if _synchronous():
        return tp_shift(a, step, group)
    return wait_prim_impl(tp_shift_start(a, step, group))


register_grad(tp_shift, _shift_grad)
comm_executor.register_implementation(tp_shift, execution_transform=_async_shift)
comm_executor.register_implementation(tp_shift_start, tp_shift_start)
