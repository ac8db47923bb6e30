"""annotate() programs under cache="symbolic values" with thunder_tp.executors(): exact (float64) vs eager; numbers
stay symbolic (another number reuses the compilation), shapes are pinned (each rank's pieces are computed from the
traced sizes, so other shapes, even or uneven, trace again)."""

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


#: each program's two shapes of call: a tuple is a float64 tensor of that shape (requiring grad), a float a number
PROGRAMS = {
    "matmul": (_matmul, [((4, 6), (6, 8)), ((5, 10), (10, 3))]),  # the second uneven at TP 2
    "mlp": (_mlp, [((3, 8), (8, 12), (12, 5)), ((5, 6), (6, 16), (16, 3))]),
    "shape_arithmetic": (_shape_arithmetic, [((4, 3, 2), (6, 5), 1.5), ((6, 2, 2), (4, 3), 2.5)]),
    "partial_sum_plus": (_partial_sum_plus, [((4, 6), (6, 5), (4, 5)), ((6, 4), (4, 3), (6, 3))]),
}


def _argument(spec: tuple | float) -> torch.Tensor | float:
    return torch.randn(*spec, dtype=torch.float64, requires_grad=True) if isinstance(spec, tuple) else spec


def _detached(x: torch.Tensor | float) -> torch.Tensor | float:
    return x.detach().clone().requires_grad_() if isinstance(x, torch.Tensor) else x


def _other_numbers(specs: tuple) -> tuple:
    """The same shapes with every number changed."""
    return tuple(s + 1.0 if isinstance(s, float) else s for s in specs)


def _symbolic_calls(name: str) -> dict[str, int]:
    """Run the first shapes, them with other numbers, then the second shapes, under TP and eagerly; compare outputs
    and grads; return the cache counts."""
    fn, (first, second) = PROGRAMS[name]
    jf = thunder.jit(fn, transforms=[TensorParallel()], executors=thunder_tp.executors(), cache="symbolic values")
    torch.manual_seed(0)
    for specs in (first, _other_numbers(first), second):
        args = [_argument(s) for s in specs]
        reference = [_detached(a) for a in args]
        out, expected = jf(*args), fn(*reference)
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
        cotangent = torch.randn_like(expected)
        (out * cotangent).sum().backward()
        (expected * cotangent).sum().backward()
        for a, r in zip(args, reference, strict=True):
            if isinstance(a, torch.Tensor):
                torch.testing.assert_close(a.grad, r.grad, rtol=1e-12, atol=1e-12)
    return {"misses": thunder.cache_misses(jf), "hits": thunder.cache_hits(jf)}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_symbolic_values_with_thunder_tp_executors(name):
    for counts in run_ranks(_symbolic_calls, 2, name):
        # other numbers reuse the first compilation; other shapes trace again
        assert counts == {"misses": 2, "hits": 1}, counts
