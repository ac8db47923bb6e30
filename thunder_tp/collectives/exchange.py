"""The all_to_all of rows with uneven split sizes (a MoE layer's dispatch and combine) and the exchange of counts that
sizes it, among the ranks of a group.

Expert parallelism sends each token to the rank of each expert it is routed to: how many rows go from which rank to
which depends on the routing, so these collectives have sizes that depend on the data, which no trace proxy can
hold. They run inside the opaque ops that need them (`thunder_tp.models.expert_parallel`), on plain tensors, through
`RankExchange`, for the ranks this process computes:

- a real rank: itself; torch.distributed's all_to_all_single with split sizes (gloo, NCCL, any backend), its
  work handle named as the trace-level collectives' are;
- `thunder_tp.simulate`: every simulated rank, their values exchanged in this process (the op computes each rank's
  part in turn, as `Ranks.for_each` does);
- `thunder_tp.one_rank`'s fake group, where no peer exists: every peer is taken to route as this rank does (it sends
  this rank what this rank sends itself) and the rows it sends are zeros, so shapes, bytes and compute are those of
  an evenly routed step and the values this rank's own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from thunder_tp.collectives.distributed import NamedWork
from thunder_tp.collectives.run_mode import ranks_of

__all__ = ["RankExchange"]

Splits = Sequence[int]


class RankExchange:
    """The ranks of `group` this process computes (`ranks`), and the all_to_alls among the ranks of the group.

    Per-rank arguments and results are lists in the order of `ranks`: one entry on a real rank, one per rank in a
    simulation."""

    def __init__(self, group: dist.ProcessGroup):
        self.group, self.size = group, group.size()
        self.run = ranks_of(group)
        self.ranks = self.run.computed
        self.computing = self.run.computing

    def values(self, value, rank: int):
        """`value` (a tensor, or a list or tuple of them, or None) as `rank` holds it."""
        if isinstance(value, (list, tuple)):
            return type(value)(self.run.value(v, rank) for v in value)
        return self.run.value(value, rank) if isinstance(value, torch.Tensor) else value

    def joined(self, per_rank: list[torch.Tensor]) -> torch.Tensor:
        """One tensor of the computed ranks' values (a LocalTensor in a simulation)."""
        return self.run.joined(per_rank)

    def counts(self, sent: list[torch.Tensor]) -> list[torch.Tensor]:
        """All_to_all of counts: each rank sends (size * n,) numbers, chunk r to rank r; each receives (size, n), row s
        from rank s."""
        if self.run.one_trace_for_all:  # every rank's values are here: exchanged in memory
            chunks = [c.view(self.size, -1) for c in sent]
            return [torch.stack([chunks[s][r] for s in range(self.size)]) for r in self.ranks]
        (mine,), (rank,) = sent, self.ranks
        if not self.run.has_peers:
            return [mine.view(self.size, -1)[rank].expand(self.size, -1).clone()]
        received = torch.empty_like(mine)
        self._wait(dist.all_to_all_single(received, mine.contiguous(), group=self.group, async_op=True), mine)
        return [received.view(self.size, -1)]

    def rows(self, sent: list[torch.Tensor], send_splits: list[Splits],
             recv_splits: list[Splits]) -> list[torch.Tensor]:
        """All_to_all of rows with uneven split sizes: each rank sends send_splits[r] rows of its tensor to rank r
        (consecutive, in rank order) and receives recv_splits[s] rows from rank s."""
        if self.run.one_trace_for_all:  # every rank's values are here: exchanged in memory
            pieces = [list(t.split(list(splits))) for t, splits in zip(sent, send_splits, strict=True)]
            return [torch.cat([pieces[s][r] for s in range(self.size)]) for r in self.ranks]
        (mine,), (send,), (recv,), (rank,) = sent, send_splits, recv_splits, self.ranks
        shape = (sum(recv), *mine.shape[1:])
        if not self.run.has_peers:  # only this rank's own rows are known
            received = mine.new_zeros(shape)
            received[sum(recv[:rank]) : sum(recv[: rank + 1])] = mine[sum(send[:rank]) : sum(send[: rank + 1])]
            return [received]
        received = mine.new_empty(shape)
        work = dist.all_to_all_single(received, mine.contiguous(), list(recv), list(send), group=self.group,
                                      async_op=True)
        self._wait(work, mine)
        return [received]

    def _wait(self, work, sent: torch.Tensor) -> None:
        """Wait for an issued all_to_all; a failure names it and its group (as the trace-level collectives do)."""
        NamedWork(work, "all_to_all", sent, self.group).wait()
