"""Thunder's rematerialization solves each distinct min-cut once: a graph of a form seen before gets its cut renamed."""

import networkx
import pytest
import thunder.core.rematerialization as rematerialization

from thunder_tp.thunder_internals import min_cuts

pytestmark = pytest.mark.usefixtures("speedups_applied")  # Thunder's speed-ups in this module's jits


def _flow_graph(prefix: str, narrow: float) -> networkx.DiGraph:
    """find_cut's shape: source -> a value in/out pair per value -> sink; the cheapest cut is the `narrow` value."""
    g = networkx.DiGraph()
    names = [f"{prefix}{i}" for i in range(4)]
    g.add_edge("source", f"{names[0]}_in", capacity=float("inf"))
    for i, name in enumerate(names):
        g.add_edge(f"{name}_in", f"{name}_out", capacity=narrow if i == 2 else 4.0)
        if i + 1 < len(names):
            g.add_edge(f"{name}_out", f"{names[i + 1]}_in", capacity=float("inf"))
    g.add_edge(f"{names[-1]}_out", "sink", capacity=float("inf"))
    return g


@pytest.fixture
def solves(monkeypatch) -> list:
    """The graphs networkx is asked to cut from here on."""
    asked = []
    monkeypatch.setattr(min_cuts.networkx, "minimum_cut",
                        lambda *args, **kwargs: asked.append(args) or networkx.algorithms.minimum_cut(*args))
    return asked


def test_rematerialization_uses_the_cached_cut():
    assert isinstance(rematerialization.nx, min_cuts._Networkx)
    assert rematerialization.nx.minimum_cut.__wrapped__ is networkx.minimum_cut  # networkx's outside thunder_tp
    assert rematerialization.nx.DiGraph is networkx.DiGraph


def test_a_graph_of_a_form_seen_before_gets_its_cut_renamed(solves):
    first = _flow_graph("a", narrow=1.0)
    assert min_cuts.minimum_cut(first, "source", "sink") == networkx.algorithms.minimum_cut(first, "source", "sink")
    solves.clear()
    renamed = _flow_graph("b", narrow=1.0)
    value, (reachable, non_reachable) = min_cuts.minimum_cut(renamed, "source", "sink")
    assert not solves, "a graph of a known form was solved again"
    assert value == 1.0
    assert reachable == {"source", "b0_in", "b0_out", "b1_in", "b1_out", "b2_in"}
    assert non_reachable == set(renamed) - reachable


def test_other_capacities_are_another_form(solves):
    min_cuts.minimum_cut(_flow_graph("c", narrow=1.0), "source", "sink")
    solves.clear()
    value, _ = min_cuts.minimum_cut(_flow_graph("d", narrow=8.0), "source", "sink")
    assert len(solves) == 1 and value == 4.0
