"""annotate() programs under cache="symbolic values": refused by TensorParallel with the fix named (each rank's
pieces are computed from the traced sizes)."""

import pytest
import thunder
import torch

import thunder_tp
from tests.dist import run_ranks
from thunder_tp import Shard, TensorParallel, annotate


def _matmul(a, b):
    return annotate(a, Shard(0)) @ annotate(b, Shard(1))


def _mlp(x, w1, w2):
    h = torch.nn.functional.gelu(x @ annotate(w1, Shard(1)))
    return h @ annotate(w2, Shard(0))  # a Partial product: summed over the sharded hidden dim


def _shape_arithmetic(x, w, s):
    rows = annotate(x, Shard(0))
    return rows.reshape(rows.shape[0], -1) @ w * (s * x.shape[1])  # sizes of a sharded and a replicated tensor


def _partial_sum_plus(a, b, c):
    # a 0-dim Partial sum is all-reduced: no symbolic dim, yet its numel is deferred. (`... .sum() + c` with c of
    # shape (4, 5) runs too, but Thunder 0.2.6 on CPU gives a 0-dim tensor broadcast in an add the unsummed grad,
    # with or without TP, so c is summed to 0-dim here.)
    return (annotate(a, Shard(1)) @ annotate(b, Shard(0))).sum() + c.sum()


#: each program's calls: a tuple is a float64 tensor of that shape (requiring grad), a float a number
PROGRAMS = {
    "matmul": (_matmul, [((4, 6), (6, 8)), ((6, 10), (10, 4))]),
    "mlp": (_mlp, [((3, 8), (8, 12), (12, 5)), ((5, 6), (6, 16), (16, 3))]),
    "shape_arithmetic": (_shape_arithmetic, [((4, 3, 2), (6, 5), 1.5), ((6, 2, 2), (4, 3), 2.5)]),
    "partial_sum_plus": (_partial_sum_plus, [((4, 6), (6, 5), (4, 5)), ((6, 4), (4, 3), (6, 3))]),
}


def _argument(spec: tuple | float) -> torch.Tensor | float:
    return torch.randn(*spec, dtype=torch.float64, requires_grad=True) if isinstance(spec, tuple) else spec


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_symbolic_values_are_refused_under_tp(name):
    """Since uneven shards each rank's pieces are computed from the traced sizes, so a program on symbolic shapes
    would run another call's shapes with the first's pieces (wrong shapes): TensorParallel refuses it, naming the fix.
    (Before uneven shards, each program's calls ran with one compilation, exact against eager.)"""
    for message in run_ranks(_refused, 2, name):
        assert "cache='symbolic values'" in message and "Jit without cache=" in message, message


def _refused(name: str) -> str:
    fn, calls = PROGRAMS[name]
    jf = thunder.jit(fn, transforms=[TensorParallel()], executors=thunder_tp.executors(), cache="symbolic values")
    with pytest.raises(NotImplementedError) as excinfo:
        jf(*(_argument(s) for s in calls[0]))
    return str(excinfo.value)
