"""What the backward keeps: an activation or product that feeds a matmul is recomputed there, not saved.

A matmul's weight grad needs its input `h`. When `h` comes out of a chain of activations and products
(`silu(a) * b` before a SwiGLU MLP's down projection, `gelu(a)` before a GELU MLP's), the backward of that
chain needs the chain's own inputs (`a`, `b`) anyway, so saving `h` and the values
between as well only adds memory. Thunder 0.2.6 avoids that by rematerializing across one forward and
one backward fusion region, but the collectives of the local program split each block into several
regions, so here every link of such a chain is tagged to be recomputed in the backward (Thunder's tag for
it, the one activation checkpointing uses): a few cheap pointwise passes instead of saved tensors.

Sums are not links (recomputing a residual sum would keep both of its addends instead of it), nor are dtype
conversions (recomputing a bf16 copy would keep its fp32 source), nor norms (their outputs stay saved, as eager
PyTorch and DTensor keep them).
"""

from __future__ import annotations

import thunder.torch as ltorch
from thunder.core import prims
from thunder.core.proxies import ProxyTag, TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx

_MATMULS = frozenset(s.id for s in (ltorch.linear, ltorch.matmul, prims.linear, prims.matmul))
_LINKS = frozenset(s.id for s in (ltorch.silu, ltorch.gelu, ltorch.relu, ltorch.sigmoid, ltorch.tanh, ltorch.mul,
                                  prims.mul))


def recompute_matmul_inputs(trace: TraceCtx) -> TraceCtx:
    """Tags (in place) each activation/product chain that feeds a matmul RECOMPUTE_IN_BACKWARD; returns ``trace``."""
    producers = {o.name: b for b in trace.bound_symbols for o in b.flat_proxy_outs}
    pending = [b.args[0] for b in trace.bound_symbols if b.sym.id in _MATMULS and isinstance(b.args[0], TensorProxy)]
    while pending:
        value = pending.pop()
        producer = producers.get(value.name)
        if producer is None or producer.sym.id not in _LINKS or ProxyTag.RECOMPUTE_IN_BACKWARD in value.tags:
            continue
        value.tags.add(ProxyTag.RECOMPUTE_IN_BACKWARD)
        pending.extend(_tensor_inputs(producer))
    return trace


def _tensor_inputs(bsym: BoundSymbol) -> list[TensorProxy]:
    return [a for a in bsym.flat_proxy_args if isinstance(a, TensorProxy)]
