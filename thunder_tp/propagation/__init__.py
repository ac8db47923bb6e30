"""Layout propagation: the engine and the rules, one module per op family."""

from thunder_tp.collectives.annotate import tp_annotate
from thunder_tp.layouts import normalize
from thunder_tp.propagation import (  # noqa: F401  (importing a family registers its rules)
    attention,
    collectives,
    embedding,
    indexing,
    losses,
    matmul,
    normalization,
    pointwise,
    reductions,
    sampling,
    views,
)
from thunder_tp.propagation.engine import Op, Propagation, Step, Strategy, register_rule


@register_rule(tp_annotate)
def annotate(op: Op) -> list[Strategy]:
    """An annotation is a constraint: its value takes the given layout."""
    layout = normalize(op.bsym.args[1], op.tensors[0].ndim)
    return [Strategy((layout,), (layout,), lambda t, *_: t)]


__all__ = ["Op", "Propagation", "Step", "Strategy", "register_rule"]
