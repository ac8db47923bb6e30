"""Thunder 0.2.6's rematerialization solves each distinct min-cut once, not once per block.

``rematerialize`` calls ``find_cut`` for every producer / consumer pair of fusion regions, which builds a flow graph
of the pair's values and runs networkx's ``minimum_cut`` on it: 157 cuts in a 32-layer pythia-14m training step on
one device, 12 s of its 95 s first call under cProfile. Consecutive blocks give pairs of the same structure, so
their graphs are the same up to the values' names. A graph's canonical form (its edges in insertion order, nodes
named by order of first appearance, with capacities) keys the cut found for it; a graph of a form seen before gets
that cut with its own names: a minimum cut of that graph (where several tie, the one found for the first graph).

Declared to ``patches`` (installed on thunder_tp's first use): the speed-up in thunder_tp's compiles, Thunder's code
in any other jit.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import networkx
import thunder.core.rematerialization as rematerialization

from thunder_tp.thunder_internals import patches

__all__ = ["minimum_cut"]

_solved: dict[Hashable, tuple[float, frozenset[int]]] = {}


def _canonical(graph: networkx.DiGraph, source: str, sink: str) -> tuple[Hashable, dict[Any, int]]:
    """The graph's form (names replaced by order of first appearance, the source and sink kept) and each node's
    position in that order."""
    order: dict[Any, int] = {source: 0, sink: 1}
    edges = tuple((order.setdefault(u, len(order)), order.setdefault(v, len(order)), capacity)
                  for u, v, capacity in graph.edges(data="capacity"))
    return edges, order


def minimum_cut(graph: networkx.DiGraph, source: str, sink: str, **kwargs: Any) -> tuple[float, tuple[set, set]]:
    """networkx's ``minimum_cut``, computed once per canonical form of the graph (``kwargs``: networkx's, uncached)."""
    if kwargs:
        return networkx.minimum_cut(graph, source, sink, **kwargs)
    form, order = _canonical(graph, source, sink)
    if form not in _solved:
        value, (reachable, _) = networkx.minimum_cut(graph, source, sink)
        _solved[form] = value, frozenset(order[node] for node in reachable)
    value, reachable_at = _solved[form]
    nodes = list(order)
    reachable = {nodes[i] for i in reachable_at}
    return value, (reachable, set(nodes) - reachable)


class _Networkx:
    """networkx as ``rematerialization`` sees it: ``minimum_cut`` solved once per form in thunder_tp's compiles, the
    rest networkx's."""

    minimum_cut = staticmethod(patches.dispatching(minimum_cut, networkx.minimum_cut))

    def __getattr__(self, name: str) -> Any:
        return getattr(networkx, name)


patches.declare(rematerialization, "nx", _Networkx())
