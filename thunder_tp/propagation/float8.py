"""Rules for torchao's float8 matmul (``thunder_tp.ops.float8``): the strategies of a linear, each computing its
casts' amaxes over the group where its pieces are cut along them, so that every rank quantizes as one device."""

from __future__ import annotations

import functools

from thunder_tp.layouts import PARTIAL, REPLICATE
from thunder_tp.ops.float8 import Cuts, float8_matmul, float8_matmul_traced
from thunder_tp.propagation.engine import Op, Strategy, register_rule


@register_rule(float8_matmul)
def float8_matmul_rule(op: Op) -> list[Strategy]:
    """a @ b (b: a weight transposed): column-parallel (b's columns: the output's features), row-parallel (the
    contracted dim: Partial), a's tokens sharded (b whole), or replicated. Never a Partial input: float8 scales a
    value, not a summand of it."""
    a, b = op.tensors
    last = a.ndim - 1
    columns, rows = op.shard_of(b, 1), op.shard_of(b, 0)

    def local(cuts: Cuts):
        return functools.partial(_on_pieces, cuts=cuts, group=op.tp.group)

    return [
        Strategy((REPLICATE, columns), (columns.moved(last),), local((None, 1, 1))),
        Strategy((rows.moved(last), rows), (PARTIAL,), local((1, 0, None))),
        *(Strategy((op.shard_of(a, d), REPLICATE), (op.shard_of(a, d),), local((0, None, 0))) for d in range(last)),
        op.replicated(),
    ]


def _on_pieces(a, b, recipe, *_whole, cuts: Cuts, group):
    """The logical op's (a, b, recipe; its cuts and group those of one device) on this rank's pieces."""
    return float8_matmul_traced(a, b, recipe, cuts, group)
