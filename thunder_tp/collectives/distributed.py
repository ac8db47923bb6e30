"""Synchronous torch.distributed implementations of the TP collectives, and work handles whose failure names them."""

from __future__ import annotations

import torch
import torch.distributed as dist

from thunder_tp.collectives.packing import Blocks, pack, unpack
from thunder_tp.layouts import Shard, local_shape, unshard_tensor
from thunder_tp.simulate import for_each_rank, is_simulating, local_piece


def all_reduce(a: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """A summed copy of `a` over `group`."""
    out = a.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def gather_full(a: torch.Tensor, layout: Shard, group: dist.ProcessGroup) -> torch.Tensor:
    """The full tensor from every rank's piece of `layout` (synchronous; replicated chunks from their first holder)."""
    size = group.size()
    out = torch.empty((size * a.shape[0], *a.shape[1:]), dtype=a.dtype, device=a.device)
    dist.all_gather_into_tensor(out, a.contiguous(), group)
    return unshard_tensor(out.view(size, *a.shape).unbind(0), layout)


def gather_shards(a: torch.Tensor, dim: int, blocks: Blocks, group: dist.ProcessGroup) -> torch.Tensor:
    """The full tensor from every rank's Shard(dim, blocks) piece (synchronous)."""
    return gather_full(a, Shard(dim, blocks), group)


def reduce_scatter(a: torch.Tensor, dim: int, blocks: Blocks, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's Shard(dim, blocks) piece of the sum over ranks of `a`."""
    size = group.size()
    packed = pack(a, dim, blocks, size)
    out = torch.empty((packed.shape[0] // size, *packed.shape[1:]), dtype=a.dtype, device=a.device)
    dist.reduce_scatter_tensor(out, packed, dist.ReduceOp.SUM, group)
    return out.view(local_shape(a.shape, Shard(dim), size))


def all_to_all(a: torch.Tensor, src_dim: int, dst_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's Shard(dst_dim) piece of the tensor whose Shard(src_dim) pieces the ranks hold (synchronous)."""
    size = group.size()
    work, received = all_to_all_start(pack(a, dst_dim, None, size), group)  # chunk r for rank r at dim-0 position r
    work.wait()
    return unpack(received, src_dim, None, size, local_shape(a.shape, Shard(dst_dim), size))


def all_to_all_start(packed: torch.Tensor, group: dist.ProcessGroup) -> tuple:
    """Issue the all_to_all of a packed tensor (chunk r for rank r along dim 0): Thunder's (work, result) future."""
    received = torch.empty_like(packed)
    work = dist.all_to_all_single(received, packed.contiguous(), group=group, async_op=True)
    return name_work((work, received), "all_to_all", packed, group)


def local(a: torch.Tensor, dim: int, blocks: Blocks, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's Shard(dim, blocks) piece of the full `a` (every simulated rank's, in a simulation)."""
    return local_piece(a, Shard(dim, blocks), dist.get_rank(group), group.size(), group)


def first_rank_only(a: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`a` on the group's first rank, zeros on the others: a Replicate value as a Partial sum, exactly."""
    if is_simulating():
        return for_each_rank(lambda r, x: x.clone() if r == 0 else torch.zeros_like(x), group, a)
    return a.clone() if dist.get_rank(group) == 0 else torch.zeros_like(a)


def rank_offset_tensor(like: torch.Tensor, step: int, group: dist.ProcessGroup) -> torch.Tensor:
    """``rank * step`` as a 0-d tensor of each simulated rank."""
    return for_each_rank(lambda r: torch.tensor(r * step, dtype=like.dtype, device=like.device), group)


class NamedWork:
    """A torch.distributed work handle whose failed ``wait`` says which collective of which group failed."""

    def __init__(self, work, kind: str, a: torch.Tensor, group: dist.ProcessGroup):
        self.work, self.kind, self.shape, self.dtype, self.group = work, kind, tuple(a.shape), a.dtype, group

    def wait(self, timeout=None) -> bool:
        """The wrapped handle's wait; a failure is re-raised naming the collective, its tensor and its group."""
        try:
            return self.work.wait() if timeout is None else self.work.wait(timeout)
        except Exception as e:
            raise RuntimeError(
                f"thunder_tp: {self.kind} of a {self.shape} {self.dtype} tensor over the "
                f"{dist.get_backend(self.group)} group of global ranks {dist.get_process_group_ranks(self.group)} "
                f"failed: {type(e).__name__}: {e}\nA peer rank of this group probably died, raised before this "
                "collective, or did not reach it within the process group's timeout (init_process_group(timeout=...)); "
                "see that rank's output."
            ) from e


def name_work(future: tuple, kind: str, a: torch.Tensor, group: dist.ProcessGroup) -> tuple:
    """Thunder's (work, result) future with its work handle named."""
    work, result = future
    return NamedWork(work, kind, a, group), result
