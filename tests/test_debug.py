"""thunder_tp.dump_traces / collectives_table on the TP MLP (2 ranks)."""

import re

import thunder
import torch

import thunder_tp
from tests.dist import run_ranks
from tests.parallel_mlp import BATCH, HIDDEN, MLP, PLAN, SEQ
from tests.tp_checks import FAST_EXECUTORS
from thunder_tp.tools.debug import CollectivesTable

ACTIVATION_BYTES = SEQ * BATCH * HIDDEN * 4  # fp32 (seq, batch, hidden)
ALL_REDUCE_IMPL = "torch_all_reduce_prim_impl"  # how thunder_tp's all_reduce is lowered (any backend)
# the MLP's one collective per pass: the row-parallel output's all_reduce (forward), the input grad's (backward)
ALL_REDUCE = {"kind": "all_reduce", "group_size": 2, "bytes_per_call": ACTIVATION_BYTES, "padding_per_call": 0,
              "count": 1,
              "total_bytes": ACTIVATION_BYTES}
FORWARD_ROW = {"issued_by": "fc2: partial sums reduced", **ALL_REDUCE}
BACKWARD_ROW = {"issued_by": "fc1: input of the TP region (its grad summed)", **ALL_REDUCE}


def _functions(text: str) -> list[str]:
    """Names of the top-level functions a printed trace defines."""
    return re.findall(r"^def (\w+)\(", text, re.MULTILINE)


def _jitted_mlp():
    torch.manual_seed(0)
    return thunder.jit(MLP(), transforms=[thunder_tp.TensorParallel(PLAN)], executors=FAST_EXECUTORS)


def _dump(directory: str, grad: bool) -> dict:
    import torch.distributed as dist

    jm = _jitted_mlp()
    x = torch.randn(SEQ, BATCH, HIDDEN, requires_grad=grad)
    with torch.set_grad_enabled(grad):
        y = jm(x)
    if grad:
        y.sum().backward()
    paths = thunder_tp.dump_traces(jm, directory)
    backward = thunder.last_backward_traces(jm)
    return {
        "traces": {"forward": str(thunder.last_traces(jm)[-1]), "backward": str(backward[-1]) if backward else None},
        "rank": dist.get_rank(),
        "paths": [str(p) for p in paths],
        "texts": {p.name: p.read_text() for p in paths},
        "forward": thunder_tp.collectives_table(thunder.last_traces(jm)[-1]),
        "backward": thunder_tp.collectives_table(backward[-1] if backward else None),
    }


def test_dump_traces_and_collectives_table(tmp_path):
    results = run_ranks(_dump, 2, str(tmp_path / "traces"), True)
    for r, res in enumerate(results):
        assert res["rank"] == r
        names = {f"rank{r}_forward.py", f"rank{r}_backward.py", f"rank{r}_collectives.md"}
        assert set(res["texts"]) == names
        assert all((tmp_path / "traces" / n).is_file() for n in names)

        assert res["forward"] == [FORWARD_ROW]
        assert res["backward"] == [BACKWARD_ROW]
        assert str(res["forward"]).splitlines() == [
            "issued by                  kind        group  bytes/call  count  total bytes",
            f"fc2: partial sums reduced  all_reduce      2  {ACTIVATION_BYTES:>10}      1  {ACTIVATION_BYTES:>11}"]
        padded = CollectivesTable([{**FORWARD_ROW, "padding_per_call": 64}])  # a padding column where one is padded
        assert str(padded).splitlines()[0].split() == ["issued", "by", "kind", "group", "bytes/call", "padding",
                                                       "count", "total", "bytes"], str(padded)

        forward = res["texts"][f"rank{r}_forward.py"]
        # the printed trace itself, each collective on one line, and a header naming its group size
        assert forward.endswith("\n" + res["traces"]["forward"] + "\n"), forward[-2000:]
        assert _functions(forward) == ["computation"], forward
        assert sum(f"{ALL_REDUCE_IMPL}(" in line for line in forward.splitlines() if not line.startswith("#")) == 1
        header = [line for line in forward.splitlines() if line.startswith("#   ") and ALL_REDUCE_IMPL in line]
        assert len(header) == 1 and "all_reduce over" in header[0] and "group size 2" in header[0], forward[:2000]
        assert header[0].endswith("; fc2: partial sums reduced"), header
        assert f"{ACTIVATION_BYTES} bytes" in header[0], header
        assert "global ranks [0, 1]" in forward
        compile(forward, "forward", "exec")  # the header keeps it a Python file
        backward = res["texts"][f"rank{r}_backward.py"]
        assert backward.endswith("\n" + res["traces"]["backward"] + "\n"), backward[-2000:]
        assert _functions(backward) == ["backward_fn"], backward
        assert sum(f"{ALL_REDUCE_IMPL}(" in line for line in backward.splitlines() if not line.startswith("#")) == 1

        table = res["texts"][f"rank{r}_collectives.md"]
        assert ("| pass | issued by | kind | group size | bytes per call | of which padding | count | total bytes |"
                in table)
        assert (f"| forward | fc2: partial sums reduced | all_reduce | 2 | {ACTIVATION_BYTES} | 0 | 1 | "
                f"{ACTIVATION_BYTES} |") in table
        assert (f"| backward | fc1: input of the TP region (its grad summed) | all_reduce | 2 | {ACTIVATION_BYTES} | "
                f"0 | 1 | {ACTIVATION_BYTES} |") in table


def test_dump_traces_without_backward(tmp_path):
    results = run_ranks(_dump, 2, str(tmp_path), False)
    for r, res in enumerate(results):
        assert set(res["texts"]) == {f"rank{r}_forward.py", f"rank{r}_collectives.md"}
        assert res["backward"] == []
        assert res["forward"] == [FORWARD_ROW]
        assert not (tmp_path / f"rank{r}_backward.py").exists()
        assert _functions(res["texts"][f"rank{r}_forward.py"]) == ["computation"]
        assert "| backward" not in res["texts"][f"rank{r}_collectives.md"]


def _unlowered_tables(executors_name: str) -> dict:
    executors = thunder.get_default_executors() if executors_name == "defaults" else FAST_EXECUTORS
    torch.manual_seed(0)
    jm = thunder.jit(MLP(), transforms=[thunder_tp.TensorParallel(PLAN)], executors=executors)
    jm(torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True)).sum().backward()
    fw, bw = thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1]
    return {
        "symbols": sorted({b.sym.name for t in (fw, bw) for b in t.bound_symbols
                           if b.sym.name.startswith(("tp_", "torch_all"))}),
        "forward": thunder_tp.collectives_table(fw),
        "backward": thunder_tp.collectives_table(bw),
    }


def test_table_of_thunder_tp_symbols_without_comm_executor():
    # comm executor not listed: thunder_tp's symbols stay in the final traces (no torchex lowering) and count too
    res = run_ranks(_unlowered_tables, 2, "defaults")[0]
    assert "tp_reduce_from_tp" in res["symbols"] and ALL_REDUCE_IMPL not in res["symbols"], res
    assert res["forward"] == [FORWARD_ROW], res
    assert res["backward"] == [BACKWARD_ROW], res
