"""Activation checkpointing as Thunder 0.2.6 records it: ``torch.utils.checkpoint`` inside a jitted program tags
what the checkpointed region computes ``ProxyTag.RECOMPUTE_IN_BACKWARD``, and Thunder recomputes those values in the
backward instead of saving them. Whatever thunder_tp emits in place of a checkpointed op carries the same tag."""

from __future__ import annotations

from thunder.core.proxies import ProxyTag
from thunder.core.symbol import BoundSymbol


def recompute_in_backward(emitted: list[BoundSymbol]) -> None:
    """Tag every output of ``emitted`` (what replaces a checkpointed op, collectives included) to be recomputed in
    the backward too."""
    for b in emitted:
        for o in b.flat_proxy_outs:
            o.tags.add(ProxyTag.RECOMPUTE_IN_BACKWARD)
