"""A step on N GPUs from one rank's measured compute and the collectives of its final traces (alpha-beta model: ring
formulas in NCCL's bus-bandwidth convention; with overlap, the trace's schedule played on compute and one link).
The method and what it leaves out: docs/gpu.md.

    link = LINKS["h100_nvlink"].overridden("all_reduce.latency_us=18")
    p = project_pass(thunder.last_backward_traces(jm)[-1], compute_s=0.120, link=link)
    p.no_overlap_s, p.overlap_s            # compute + every collective; the same on the trace's schedule
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from thunder.core.proxies import TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx

from benchmarks.lib import harness
from thunder_tp import costs

KINDS = ("all_reduce", "all_gather", "reduce_scatter")
#: a decomposed collective's piece: one rank's bytes to one peer (thunder_tp's shifts); priced if a link names it
SEND_RECV = "send_recv"
MATMULS = {"linear", "matmul", "mm", "bmm", "addmm", "torch_linear", "torch_matmul"}
#: symbols that only name or forward an issued collective's handle (thunder_tp's tp_name_work)
PASS_THROUGH = {"tp_name_work"}


@dataclass(frozen=True)
class Link:
    """Alpha-beta parameters per collective kind: latency (s) and bus bandwidth (bytes/s), with their sources."""

    name: str
    latency_s: dict[str, float]
    bus_bytes_per_s: dict[str, float]
    sources: dict[str, str] = field(default_factory=dict)

    def seconds(self, kind: str, nbytes: float, group_size: int) -> float:
        """One collective's time (ring formulas)."""
        if group_size <= 1:
            return 0.0
        if kind == SEND_RECV:
            numbers = SEND_RECV if SEND_RECV in self.latency_s else "all_gather"
            return self.latency_s[numbers] + nbytes / self.bus_bytes_per_s[numbers]
        kind = kind if kind in KINDS else "all_gather"
        return self.latency_s[kind] + costs.ring_factor(kind, group_size) * nbytes / self.bus_bytes_per_s[kind]

    def overridden(self, spec: str) -> Link:
        """A copy with ``kind.latency_us=X`` / ``kind.bus_gbps=Y`` (comma-separated; kind ``all`` for every kind)."""
        latency, bandwidth, sources = dict(self.latency_s), dict(self.bus_bytes_per_s), dict(self.sources)
        for item in filter(None, (s.strip() for s in spec.split(","))):
            try:
                key, value = item.split("=")
                kind, what = key.split(".")
                number = float(value)
            except ValueError:
                raise ValueError(f"--link_override: {item!r} is not kind.latency_us=X or kind.bus_gbps=Y "
                                 f"(kinds: {', '.join(KINDS)}, all)") from None
            kinds = KINDS if kind == "all" else (kind,)
            if not set(kinds) <= {*KINDS, SEND_RECV} or what not in ("latency_us", "bus_gbps"):
                raise ValueError(f"--link_override: unknown {key!r}; use "
                                 f"<{'|'.join((*KINDS, SEND_RECV))}|all>.<latency_us|bus_gbps>")
            for k in kinds:
                if k not in latency:  # a kind the link prices as another until given numbers of its own
                    latency[k], bandwidth[k] = latency["all_gather"], bandwidth["all_gather"]
                if what == "latency_us":
                    latency[k] = number * 1e-6
                else:
                    bandwidth[k] = number * 1e9
                sources[f"{k}.{what}"] = "command line"
        return replace(self, latency_s=latency, bus_bytes_per_s=bandwidth, sources=sources)

    def table(self) -> str:
        """The parameters as a markdown table with their sources."""
        rows = [[k, f"{self.latency_s[k] * 1e6:.1f}", f"{self.bus_bytes_per_s[k] / 1e9:.2f}",
                 "; ".join(s for key, s in self.sources.items() if key.startswith(k) or key == "all")]
                for k in (*KINDS, SEND_RECV) if k in self.latency_s]
        table = harness.table("kind | latency (µs)> | bus bandwidth (GB/s)> | source", rows)
        return "\n".join([f"alpha-beta parameters ({self.name}):", "", *table])


_SAME = "assumed as all_reduce's (only NCCL's all_reduce latency is given)"
#: the links the projection knows: ``thunder_tp/costs.py``'s, their (all_reduce's) figures for every kind; ``--link``
#: picks one, ``--link_override`` changes its numbers
LINKS: dict[str, Link] = {
    name: Link(f.description, dict.fromkeys(KINDS, f.latency_s), dict.fromkeys(KINDS, f.bus_bytes_per_s),
               {"all_reduce": f.source, "all_gather": _SAME, "reduce_scatter": _SAME})
    for name, f in ((n, costs.LINKS[n]) for n in ("h100_nvlink", "h100_nvlink_graph"))}


#: torchtitan's Llama-3-8B training on 64 H100s, FSDP 8 x TP 8, bf16: tokens/s/GPU (docs/gpu.md)
TORCHTITAN_8B = {"without async TP": 4378, "async TP": 4809}


def _shape(p) -> tuple[int, ...]:
    return tuple(int(d) for d in p.shape)


def _matmul_flops(bsym: BoundSymbol) -> float:
    tensors = [a for a in bsym.flat_args if isinstance(a, TensorProxy)]
    out = next((o for o in bsym.flat_outs if isinstance(o, TensorProxy)), None)
    if len(tensors) < 2 or out is None:
        return 0.0
    k = _shape(tensors[0])[-1] if tensors[0].ndim else 1
    return 2.0 * math.prod(_shape(out)) * k


def _attention_flops(bsym: BoundSymbol) -> float:
    """4 b h s_q s_k d for the forward (QK^T and PV); a backward symbol counts 2.5 times that."""
    q, k = [a for a in bsym.flat_args if isinstance(a, TensorProxy)][:2]
    *batch, s_q, d = _shape(q)
    flops = 4.0 * math.prod(batch) * s_q * _shape(k)[-2] * d
    return 2.5 * flops if "backward" in bsym.sym.name else flops


def flops(bsym: BoundSymbol, matmul: Callable[[BoundSymbol], float] = _matmul_flops) -> float:
    """Matmul and attention FLOPs of a bound symbol (its subsymbols' for a fusion region or a composite)."""
    name = bsym.sym.name
    if name in MATMULS:
        return matmul(bsym)
    if "scaled_dot_product" in name or "sdpa" in name:
        return _attention_flops(bsym)
    return sum(flops(s, matmul) for s in bsym.subsymbols)


@dataclass(frozen=True)
class PassProjection:
    compute_s: float
    comm_s: float  # every collective's time, one after the other
    no_overlap_s: float
    overlap_s: float
    collectives: list[dict]  # kind, bytes, group_size, seconds, hidden_s


@dataclass(frozen=True)
class RecordedPass:
    """A pass's collectives counted at runtime (``[kind, group size, bytes]``): no schedule, so no overlap."""

    calls: list


def _names(proxies: Iterable) -> set[str]:
    return {p.name for p in proxies if hasattr(p, "name")}


def project_pass(trace: TraceCtx | RecordedPass | None, compute_s: float, link: Link,
                 weigh: Callable[[BoundSymbol], float] = flops) -> PassProjection:
    """The pass's time with ``trace``'s collectives on ``link``, without and with the overlap its schedule allows."""
    from thunder_tp.tools.debug import collective_calls
    if trace is None:
        return PassProjection(compute_s, 0.0, compute_s, compute_s, [])
    if isinstance(trace, RecordedPass):
        records = [{"kind": k, "bytes": b, "group_size": n, "seconds": link.seconds(k, b, n)}
                   for k, n, b in trace.calls]
        comm = sum(r["seconds"] for r in records)
        return PassProjection(compute_s, comm, compute_s + comm, compute_s + comm, records)
    calls = {id(c["bsym"]): c for c in collective_calls(trace)}
    share = _compute_shares(trace, calls, compute_s, weigh)
    clock = link_free = 0.0
    pending: dict[str, dict] = {}  # a name carrying an issued collective -> its record
    records = []
    for bsym in trace.bound_symbols:
        call = calls.get(id(bsym))
        consumed = [pending[n] for n in _names(bsym.flat_args) if n in pending]
        if call is not None:
            start = max(clock, link_free)
            seconds = link.seconds(call["kind"], call["bytes"], call["group_size"])
            link_free = start + seconds
            record = {"kind": call["kind"], "bytes": call["bytes"], "group_size": call["group_size"],
                      "seconds": seconds, "issued_s": clock, "done_s": link_free}
            records.append(record)
            pending.update(dict.fromkeys(_names(bsym.flat_outs), record))
            continue
        if consumed and bsym.sym.name in PASS_THROUGH:
            pending.update(dict.fromkeys(_names(bsym.flat_outs), consumed[0]))
            continue
        for record in consumed:  # a wait, or the first use of a synchronous collective's result
            clock = max(clock, record["done_s"])
        clock += share.get(id(bsym), 0.0)
    comm = sum(r["seconds"] for r in records)
    serial = compute_s + comm  # the schedule only hides time: rounding in the shares' sum must not add any
    return PassProjection(compute_s, comm, serial, min(max(clock, link_free), serial), records)


def _compute_shares(trace: TraceCtx, calls: dict, compute_s: float,
                    weigh: Callable[[BoundSymbol], float]) -> dict[int, float]:
    """Each non-collective top-level symbol's share of the pass's compute: by ``weigh`` (matmul and attention FLOPs), or
    evenly where the pass has none."""
    weights = {id(b): weigh(b) for b in trace.bound_symbols if id(b) not in calls}
    total = sum(weights.values())
    if total == 0:
        weights, total = dict.fromkeys(weights, 1.0), float(len(weights) or 1)
    return {k: compute_s * w / total for k, w in weights.items()}


@dataclass(frozen=True)
class StepProjection:
    no_overlap_s: float
    overlap_s: float
    comm_s: float
    passes: dict[str, PassProjection]


def project_step(traces: dict[str, TraceCtx | None], compute_s: dict[str, float], link: Link,
                 other_s: float = 0.0) -> StepProjection:
    """A step of passes (``{name: trace}`` with their compute) plus ``other_s`` without collectives."""
    passes = {name: project_pass(traces.get(name), compute_s[name], link) for name in compute_s}
    return StepProjection(
        no_overlap_s=sum(p.no_overlap_s for p in passes.values()) + other_s,
        overlap_s=sum(p.overlap_s for p in passes.values()) + other_s,
        comm_s=sum(p.comm_s for p in passes.values()),
        passes=passes,
    )


def extrapolate(value_at: dict[int, float], layers: int) -> float:
    """A per-step figure at ``layers`` layers, linear in the depth through the two measured depths."""
    (d0, v0), (d1, v1) = sorted(value_at.items())[:2]
    return v0 + (layers - d0) * max(v1 - v0, 0.0) / (d1 - d0)
