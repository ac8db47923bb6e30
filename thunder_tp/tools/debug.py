"""Inspecting what a TP-jitted program runs: its final traces, the collectives they issue, what they save.

    jm = thunder.jit(model, transforms=[TensorParallel(plan)], executors=thunder_tp.executors())
    loss = jm(x); loss.backward()
    thunder_tp.dump_traces(jm, "traces")          # every rank: traces/rank{r}_forward.py, ...
    print(thunder_tp.collectives_table(thunder.last_traces(jm)[-1]))
    # issued by                      kind        group  bytes/call  count  total bytes
    # net2: partial sums reduced     all_reduce      2       65536      1        65536

Collectives are found as ``thunder_tp.collectives.calls`` finds them (the top-level bound symbols of a trace that
issue one, thunder_tp's and Thunder's DDP/FSDP's).

Sizes are per rank: the trace is the rank's local program, so its proxies have local shapes. Each collective
thunder_tp inserted says which module it serves and what it does (``thunder_tp.collectives.labels``); the table
names blocks' modules with ``*`` for the layer (one row for all blocks), the dump's header each call exactly.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from thunder.core import prims
from thunder.core.proxies import TensorProxy
from thunder.core.pytree import tree_flatten
from thunder.core.trace import TraceCtx

from thunder_tp.collectives.calls import UNLABELLED, collective_calls, collective_kind, group_size
from thunder_tp.collectives.labels import layers_globbed
from thunder_tp.collectives.run_mode import ranks_of

__all__ = ["UNLABELLED", "CollectivesTable", "collective_calls", "collective_kind", "collectives_table",
           "dump_traces", "format_table", "totals"]


class CollectivesTable(list):
    """The rows of :func:`collectives_table` (a list of dicts), printed as an aligned table."""

    _COLUMNS = (("issued_by", "issued by"), ("kind", "kind"), ("group_size", "group"),
                ("bytes_per_call", "bytes/call"), ("padding_per_call", "padding"), ("count", "count"),
                ("total_bytes", "total bytes"))

    def __str__(self) -> str:
        if not self:
            return "(no collectives)"
        padded = any(row["padding_per_call"] for row in self)  # the padding column only where a piece was padded
        columns = [(k, title) for k, title in self._COLUMNS if padded or k != "padding_per_call"]
        cells = [[title for _, title in columns]] + [[str(row[k]) for k, _ in columns] for row in self]
        widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
        def line(values):
            aligned = (v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths, strict=True)))
            return "  ".join(aligned)
        return "\n".join(line(values).rstrip() for values in cells)


def collectives_table(trace: TraceCtx | None) -> CollectivesTable:
    """The collectives of a final trace, one row per (what issued them, kind, group size, bytes per call).

    Each row: ``issued_by`` ("module: what it does", a block's module with ``*`` for its layer index, so that one
    row counts every block's), ``kind`` (all_reduce / all_gather / reduce_scatter / all_to_all / broadcast;
    send_recv for a piece of a collective decomposed for overlap: one rank's bytes to one peer), ``group_size``,
    ``bytes_per_call`` (bytes of the communicated tensor on this rank; for all_gather the gathered output),
    ``padding_per_call`` (how many of those bytes pad shorter pieces to the longest: a size that does not divide a
    dim), ``count`` and ``total_bytes``. Rows are in order of first appearance; ``print`` shows them as a table.
    ``None`` gives an empty table.
    """
    rows: dict[tuple, dict] = {}
    for call in collective_calls(trace) if trace is not None else ():
        key = (layers_globbed(call["issued_by"]), call["kind"], call["group_size"], call["bytes"], call["padding"])
        row = rows.setdefault(key, {"issued_by": key[0], "kind": key[1], "group_size": key[2],
                                    "bytes_per_call": key[3], "padding_per_call": key[4], "count": 0,
                                    "total_bytes": 0})
        row["count"] += 1
        row["total_bytes"] += call["bytes"]
    return CollectivesTable(rows.values())


def totals(table: Iterable[dict]) -> dict[str, dict[str, int]]:
    """``{kind: {"count": n, "bytes": b}}`` summed over the rows of a :func:`collectives_table`."""
    out: dict[str, dict[str, int]] = {}
    for row in table:
        t = out.setdefault(row["kind"], {"count": 0, "bytes": 0})
        t["count"] += row["count"]
        t["bytes"] += row["total_bytes"]
    return out


def format_table(tables: dict[str, list[dict]]) -> str:
    """A markdown table of ``{pass name: collectives_table}``."""
    lines = [
        "| pass | issued by | kind | group size | bytes per call | of which padding | count | total bytes |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, table in tables.items():
        if not table:
            lines.append(f"| {name} | | (none) | | | | 0 | 0 |")
        for r in table:
            lines.append(
                f"| {name} | {r['issued_by']} | {r['kind']} | {r['group_size']} | {r['bytes_per_call']} | "
                f"{r['padding_per_call']} | "
                f"{r['count']} | {r['total_bytes']} |"
            )
    return "\n".join(lines) + "\n"


def _rank() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _group_names(trace: TraceCtx, text: str) -> dict[str, Any]:
    """The names that the printed ``text`` of ``trace`` gives to process groups (``..._ProcessGroup_0``)."""
    try:
        ctx = trace.python_ctx()
    except Exception:  # naming is cosmetic; never fail a dump over it
        return {}
    return {
        name: obj
        for name, obj in ctx.items()
        if isinstance(obj, dist.ProcessGroup) and re.search(rf"\b{re.escape(name)}\b", text)
    }


def _describe_group(group: Any) -> str:
    size = group_size(group)
    try:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
        return f"size {size}, global ranks {ranks}"
    except Exception:
        return f"size {size}"


def _header(trace: TraceCtx, text: str, pass_name: str, rank: int, world: int) -> str:
    """Comment lines: the collectives of ``trace`` with their group sizes, and what each printed group is."""
    calls = collective_calls(trace)
    groups = _group_names(trace, text)
    group_name = {id(g): name for name, g in groups.items()}
    lines = [
        f"# thunder_tp trace dump: {pass_name} trace of rank {rank} (world size {world})",
        f"# collectives: {len(calls)}",
    ]
    for c in calls:
        outs = [o for o in c["bsym"].flat_outs if hasattr(o, "name")]
        name = outs[0].name if outs else "?"
        where = group_name.get(id(c["group"]), "")
        where = f" over {where}" if where else ""
        lines.append(
            f"#   {name} = {c['bsym'].sym.name}(...): {c['kind']}{where}, group size {c['group_size']}, {c['bytes']} "
            f"bytes; {c['issued_by']}"
        )
    if groups:
        lines.append("# process groups:")
        lines.extend(f"#   {name}: {_describe_group(g)}" for name, g in sorted(groups.items()))
    return "\n".join(lines) + "\n\n"


def saved_for_backward(forward_trace: TraceCtx) -> list[TensorProxy] | None:
    """The distinct tensors a forward trace returns for the backward (``return output, (saved, other)``);
    None when it saves nothing (no backward)."""
    ret = next((b for b in reversed(forward_trace.bound_symbols) if b.sym.id == prims.PrimIDs.RETURN), None)
    if ret is None or len(ret.args) != 2 or not isinstance(ret.args[1], (tuple, list)) or not ret.args[1]:
        return None
    return list({p.name: p for p in tree_flatten(ret.args[1][0])[0] if isinstance(p, TensorProxy)}.values())


def _last(traces) -> TraceCtx | None:
    return traces[-1] if traces else None


def dump_traces(jitted, directory: str | os.PathLike) -> list[Path]:
    """Write this rank's final traces and a table of its collectives into ``directory``; return the paths.

    Files: ``rank{r}_forward.py`` and ``rank{r}_backward.py`` (the final traces as Thunder prints them,
    preceded by a comment listing the collectives with their group sizes, since the printed trace names a
    ProcessGroup opaquely) and ``rank{r}_collectives.md`` (pass, kind, group size, bytes per call, count,
    total bytes). Every rank calls it and writes its own files; inside ``thunder_tp.simulate`` one call writes
    the files of every simulated rank (they all run the same trace). Without a backward trace (a no-grad run)
    there is no backward file (a stale one from an earlier dump is removed).
    """
    import thunder

    forward = _last(thunder.last_traces(jitted))
    if forward is None:
        raise RuntimeError("dump_traces: the jitted function has no traces yet; call it at least once first")
    backward = _last(thunder.last_backward_traces(jitted))
    rank, world = _rank()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ranks = ranks_of().computed if dist.is_initialized() else (rank,)
    return [path for r in ranks for path in _write_rank_files(directory, forward, backward, r, world)]


def _write_rank_files(directory: Path, forward: TraceCtx, backward: TraceCtx | None, rank: int,
                      world: int) -> list[Path]:
    written = []
    tables = {}
    for pass_name, trace in (("forward", forward), ("backward", backward)):
        path = directory / f"rank{rank}_{pass_name}.py"
        if trace is None:
            path.unlink(missing_ok=True)
            continue
        text = str(trace)  # prints first: that names the objects (process groups) the header refers to
        path.write_text(_header(trace, text, pass_name, rank, world) + text + "\n")
        written.append(path)
        tables[pass_name] = collectives_table(trace)

    path = directory / f"rank{rank}_collectives.md"
    path.write_text(f"# Collectives of rank {rank} (world size {world})\n\n" + format_table(tables))
    written.append(path)
    return written
