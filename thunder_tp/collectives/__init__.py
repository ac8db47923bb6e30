"""Collective symbols of the TP group, their conjugate grads and torch.distributed implementations.

    symbols       the symbols of `comm_executor`, their result shapes and conjugate grads; what is communication
    distributed   their synchronous torch.distributed implementations; work handles whose failure names them
    lowering      how `comm_executor` runs them: async torchex prims + wait, local ops the fusion executor claims
    packing       shards (blocked, uneven: padded) packed into / out of the dim-0 order of torch.distributed's
                  collectives
    shift         a cyclic shift over the group (send to rank + step, receive from rank - step): decomposed collectives
    exchange      all_to_alls with uneven split sizes (expert parallelism's dispatch and combine) inside opaque ops
"""

from thunder_tp.collectives import lowering  # noqa: F401  (importing it registers the symbols' executions)
from thunder_tp.collectives.distributed import gather_full, gather_shards
from thunder_tp.collectives.shift import tp_shift
from thunder_tp.collectives.symbols import (
    COLLECTIVE_KINDS,
    COMM_IDS,
    ISSUED_INSIDE,
    comm_executor,
    is_communication,
    is_wait,
    rank_value,
    register_issued_collectives,
    tp_all_to_all,
    tp_copy_all_to_tp,
    tp_copy_to_tp,
    tp_gather,
    tp_gather_to_tp,
    tp_max_all_reduce,
    tp_padded_piece,
    tp_padding_filled,
    tp_placed,
    tp_reduce_from_tp,
    tp_reduce_scatter,
    tp_scatter,
    tp_taken,
    tp_to_partial,
)

__all__ = [
    "COLLECTIVE_KINDS",
    "COMM_IDS",
    "ISSUED_INSIDE",
    "comm_executor",
    "is_communication",
    "is_wait",
    "gather_full",
    "gather_shards",
    "rank_value",
    "register_issued_collectives",
    "tp_all_to_all",
    "tp_copy_all_to_tp",
    "tp_copy_to_tp",
    "tp_gather",
    "tp_gather_to_tp",
    "tp_max_all_reduce",
    "tp_padded_piece",
    "tp_padding_filled",
    "tp_placed",
    "tp_reduce_from_tp",
    "tp_reduce_scatter",
    "tp_scatter",
    "tp_shift",
    "tp_taken",
    "tp_to_partial",
]
