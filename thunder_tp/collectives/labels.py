"""Which module and op issued a collective: a label carried as a tag of its bound symbols.

The rewrite tags every communication symbol it emits with a `CollectiveLabel` ("transformer.h.0.attn.proj: partial
sums reduced"). Thunder passes a bound symbol's tags on to what replaces it: the lowering to async torchex prims
(`_transform_for_operator_executor_execution`) and the grad transform, whose backward symbols, a collective's
conjugate among them, inherit them. So the final forward and backward traces carry the label on every collective
that thunder_tp inserted (Thunder's own DDP / FSDP collectives carry none).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from thunder.core.symbol import BoundSymbol

from thunder_tp.collectives.symbols import ISSUED_INSIDE, comm_executor


@dataclass(frozen=True)
class CollectiveLabel:
    """A bound-symbol tag: the module (or op) whose value the collective communicates, and what it does to it."""

    text: str


def label_collectives(bsyms: Iterable[BoundSymbol], text: str) -> None:
    """Tag each communication symbol of `bsyms` that has no label yet with `text`."""
    for bsym in bsyms:
        ours = bsym.sym.executor is comm_executor or bsym.sym.name in ISSUED_INSIDE
        if ours and label_of(bsym) is None:
            bsym.tags.add(CollectiveLabel(text))


def label_of(bsym: BoundSymbol) -> str | None:
    """The label of a (lowered, or differentiated) collective's bound symbol, if it has one."""
    return next((t.text for t in bsym.tags if isinstance(t, CollectiveLabel)), None)


def layers_globbed(label: str) -> str:
    """The label with every layer index as `*` (`transformer.h.*.attn.proj: ...`): one row for all blocks."""
    return re.sub(r"(?<=\.)\d+(?=\.|:|$)", "*", label)
