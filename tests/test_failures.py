"""A rank that dies, raises or hangs makes its TP peer raise, with an error naming the collective and the group:
quickly when the peer's process is gone (gloo sees the connection reset), within the process group's timeout when it
is alive but never joins the collective.

Ranks are two plain processes, forked from the test pools' fork server (torch and Thunder imported; no torchrun
agent, not the pool's workers); the parent only watches them.
"""

import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tests.dist import free_port, run_ranks, start_forked

STEPS = 4
FAILING_STEP = 2
SURVIVOR_LIMIT_S = 60.0
#: process-group timeout of the pair in which rank 1 hangs (alive, never joining the next collective)
HANG_TIMEOUT_S = 5.0


def _rank_main(mode: str, rank: int, port: int) -> None:
    """One rank training the TP=2 MLP; rank 1 fails at FAILING_STEP as ``mode`` says (die, raise or hang)."""
    import datetime

    import thunder
    import torch
    import torch.distributed as dist

    import thunder_tp
    from tests.parallel_mlp import MLP, PLAN, mlp_input
    from tests.tp_checks import FAST_EXECUTORS

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=HANG_TIMEOUT_S) if mode == "hang" else None
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}", timeout=timeout)
    torch.manual_seed(0)
    # the input check's all_gather off: these tests are about the model's own collectives (test_peer_raising_
    # before_the_input_check is about that one)
    check_inputs = "training" if mode == "raise_before_check" else "first"
    transform = thunder_tp.TensorParallel(PLAN, check_inputs=check_inputs)
    jm = thunder.jit(MLP(), transforms=[transform], executors=FAST_EXECUTORS)
    (x,) = mlp_input()
    try:
        for step in range(STEPS):
            failing = rank == 1 and step == FAILING_STEP
            if failing:
                print(f"failing at {time.monotonic()}", flush=True)  # CLOCK_MONOTONIC: one clock for the host
            if failing and mode in ("raise", "raise_before_check"):
                raise ValueError("rank 1 fails before its next collective")
            if failing and mode == "hang":
                time.sleep(10 * SURVIVOR_LIMIT_S)  # alive, but never reaches the forward all_reduce
            loss = jm(x).square().mean()
            if failing and mode == "die":
                os._exit(3)  # mid step: after the forward all_reduce, before the backward one
            loss.backward()
    except RuntimeError:
        print(f"raised at {time.monotonic()}", flush=True)
        raise
    print("finished every step", flush=True)


def _stamp(text: str, event: str) -> float:
    return float(next(line.split(" at ")[1] for line in text.splitlines() if line.startswith(event + " at ")))


def _run_pair(mode: str) -> tuple[subprocess.CompletedProcess, float, float]:
    """Rank 0's outcome, how long after rank 1 failed it raised, and how long after rank 1 exited it exited."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix=f"failures-{mode}-") as logs:
        outputs = [(Path(logs, f"rank{r}.out"), Path(logs, f"rank{r}.err")) for r in range(2)]
        procs = [start_forked(_rank_main, mode, r, port, name=f"{mode}-rank{r}", stdout=str(out), stderr=str(err))
                 for r, (out, err) in enumerate(outputs)]
        try:
            if mode == "hang":  # rank 1 stays alive: rank 0 has to give up on its own
                procs[0].join(300)
                procs[1].kill()
                after = float("nan")
            else:
                procs[1].join(300)
                died = time.monotonic()
                procs[0].join(SURVIVOR_LIMIT_S + 30)
                after = time.monotonic() - died
        finally:
            for p in procs:
                p.kill()
                p.join()
        out, err = (path.read_text() for path in outputs[0])
        failed = outputs[1][0].read_text()
    assert procs[0].exitcode is not None and procs[0].exitcode >= 0, f"rank 0 did not finish: {out}{err[-3000:]}"
    assert procs[1].exitcode != 0, "rank 1 was meant to fail"
    raised = _stamp(out, "raised") - _stamp(failed, "failing") if "raised at" in out else float("nan")
    return subprocess.CompletedProcess(mode, procs[0].exitcode, out, err), raised, after


def _check_survivor(mode: str, kind: str, tensor: str = "(32, 4, 128) torch.float32") -> float:
    """Rank 0's error after rank 1 failed as ``mode`` says; how long after rank 1's failure rank 0 raised."""
    survivor, raised, after = _run_pair(mode)
    exited = "" if mode == "hang" else f"; exited {after:.1f} s after rank 1"
    print(f"{mode}: rank 0 raised {raised:.1f} s after rank 1 failed{exited} (rc {survivor.returncode})")
    assert survivor.returncode != 0, survivor.stdout + survivor.stderr
    assert "finished every step" not in survivor.stdout
    message = f"thunder_tp: {kind} of a {tensor} tensor over the gloo group of global ranks [0, 1] failed"
    assert message in survivor.stderr, survivor.stderr[-3000:]
    if mode != "hang":
        assert after < SURVIVOR_LIMIT_S, after
    return raised


def test_peer_killed_mid_step_is_an_error_within_seconds():
    _check_survivor("die", "all_reduce")  # the backward all_reduce of the input grad


def test_peer_raising_before_a_collective_does_not_hang():
    _check_survivor("raise", "all_reduce")  # the forward all_reduce of the next step


def test_peer_raising_before_the_input_check_does_not_hang():
    _check_survivor("raise_before_check", "the input check's all_gather", "(2,) torch.int64")  # check_inputs="training"


def test_hung_peer_is_an_error_after_the_process_group_timeout():
    raised = _check_survivor("hang", "all_reduce")  # the forward all_reduce rank 1 never joins
    # gloo's timeout, which thunder_tp neither shortens nor disables: not before it, and not much after it
    assert HANG_TIMEOUT_S - 1 <= raised < HANG_TIMEOUT_S + 30, raised


# --- a compile error on one rank only: every rank raises, and the pair of processes goes on to the next model ----


class _FailsTracingOnRank(torch.nn.Module):
    """The TP MLP whose forward raises while Thunder traces it, on `failing_rank` only."""

    def __init__(self, failing_rank: int):
        super().__init__()
        from tests.parallel_mlp import MLP

        self.mlp, self.failing = MLP(), dist.get_rank() == failing_rank

    def forward(self, x):
        if self.failing:
            raise ValueError("a rank-local tracing error")
        return self.mlp(x)


def _compile_fails_on_one_rank(failing_rank: int) -> list[str]:
    """Two jitted modules in a row in this process pair: the first fails to compile on one rank; the second runs."""
    import thunder

    import thunder_tp
    from tests.parallel_mlp import MLP, PLAN, mlp_input
    from tests.tp_checks import FAST_EXECUTORS

    (x,) = mlp_input()
    plan = {f"mlp.{name}": style for name, style in PLAN.items()}
    broken = thunder.jit(_FailsTracingOnRank(failing_rank), transforms=[thunder_tp.TensorParallel(plan)],
                         executors=FAST_EXECUTORS)
    try:
        broken(x)
        outcome = "compiled"
    except (ValueError, RuntimeError) as error:
        outcome = f"{type(error).__name__}: {error} {getattr(error, '__notes__', '')}"
    torch.manual_seed(0)
    working = thunder.jit(MLP(), transforms=[thunder_tp.TensorParallel(PLAN)], executors=FAST_EXECUTORS)
    working(x).sum().backward()  # the pair is still in step: the next model's collectives match
    return [outcome]


def test_compile_error_on_one_rank_is_an_error_on_every_rank():
    outcomes = run_ranks(_compile_fails_on_one_rank, 2, 1, timeout=120)
    peer, failing = outcomes[0][0], outcomes[1][0]
    assert failing.startswith("ValueError: a rank-local tracing error"), failing
    assert "other ranks of the TP group were told" in failing, failing
    assert peer.startswith("RuntimeError: thunder_tp: rank(s) [1] of the TP group of global ranks [0, 1] failed to "
                           "compile"), peer
