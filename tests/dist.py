"""Multi-process test harness: run a function on N real gloo ranks.

    from tests.dist import run_ranks

    def _body(x):                      # module level, so workers can import it
        import torch, torch.distributed as dist
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item() + x

    def test_sum():
        assert run_ranks(_body, 2, 1.0) == [2.0, 2.0]

Design
------
* One pool of ``world_size`` worker processes per world size, created lazily on
  first use and kept for the rest of the process, so a test pays neither process
  start-up nor ``import torch``/``import thunder`` again.  Pools are shut down at
  exit (``atexit``; ``tests/conftest.py`` also does it at the end of the pytest
  session).
* Workers are forked from a fork server (the ``forkserver`` start method) that
  imported ``PRELOADED_MODULES`` once, with ``OMP_NUM_THREADS=1`` set before it
  imported torch: a pool starts without about 20 s of imports per rank, and a
  pool started again after a failure too.  Each worker calls
  ``torch.set_num_threads(1)`` and joins ``init_process_group("gloo")`` over
  ``tcp://127.0.0.1:<port>``.  The port is found free at pool creation (bind to
  port 0) and kept bound (SO_REUSEADDR, not listening) by the parent until the
  workers are up, so concurrent pools and concurrent test runs never collide.
* ``fn`` and its arguments are pickled once in the parent (functions by
  reference) and sent to every rank; each rank answers with its pickled result
  or its formatted traceback.
* After a task in which every rank answered, the parent makes all ranks run a
  ``barrier()`` so they stay in lock-step.  If a rank raised while others are
  stuck (typically in a collective the failed rank never joined), the others
  get ``FAILURE_GRACE_S`` seconds to finish, then their Python stacks are dumped
  (faulthandler) into the error message and the pool is killed; the next call
  creates a fresh one.  The same happens after ``timeout`` seconds, or when a
  worker dies.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing import connection as mp_connection
from typing import Any

# NOTE: no module-level torch import. Workers import this module before their
# entry point runs, and OMP_NUM_THREADS must be set before torch is loaded.

__all__ = [
    "run_ranks",
    "start_forked",
    "free_port",
    "assert_close",
    "shutdown_pools",
    "RanksFailed",
    "FAILURE_GRACE_S",
]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: After the first rank fails, how long the remaining ranks may still take before
#: the pool is killed (they are usually stuck in a collective).
FAILURE_GRACE_S = 30.0
#: Limit for starting a pool (process start + import torch + init_process_group).
STARTUP_TIMEOUT_S = 300.0
#: Limit for the post-task barrier (all ranks are idle, so this is generous).
SYNC_TIMEOUT_S = 30.0
#: Attempts at creating a pool (a new port each time) before giving up.
STARTUP_ATTEMPTS = 3

_WORKER_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
#: What the fork server imports before forking the first worker (no threads started by any of them): torch, Thunder,
#: thunder_tp and litgpt, which the tests' workers import (through the tests' shared modules) about 20 s per rank.
PRELOADED_MODULES = ["torch", "torch.distributed", "thunder", "thunder_tp", "litgpt", "tests.tp_checks",
                     "tests.litgpt_models"]
if sys.platform.startswith("linux"):
    # Everything runs on loopback; don't depend on the hostname resolving.
    _WORKER_ENV_DEFAULTS = {"GLOO_SOCKET_IFNAME": "lo"}
else:
    _WORKER_ENV_DEFAULTS = {}


class RanksFailed(AssertionError):
    """Raised by :func:`run_ranks` when a rank raised, died, hung or timed out.

    ``errors`` maps rank -> traceback (or description) for every rank that failed.
    """

    def __init__(self, message: str, errors: dict[int, str]):
        super().__init__(message)
        self.errors = errors


# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_torchrun(command: list[str], *, timeout: float, nproc: int = 2, cwd: str = REPO_ROOT):
    """Run `command` (a script and its arguments, or ``-m module ...``) on `nproc` ranks under torchrun, with this
    checkout's thunder_tp first on the path and one thread per rank; the finished process, whatever its exit code.
    The launch runs in its own session, so a timeout (a test failure) or an interrupt kills the ranks too, not only
    torchrun."""
    import subprocess

    import pytest

    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    path = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # everything is on loopback, as the pools above
    proc = subprocess.Popen([*launcher, *command], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{' '.join(command)} did not finish within {timeout} s\n{stdout[-3000:]}\n{stderr[-5000:]}")
    finally:
        if proc.poll() is None:  # interrupted
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def torchrun(command: list[str], *, timeout: float, nproc: int = 2, cwd: str = REPO_ROOT) -> tuple[str, str]:
    """`launch_torchrun`, its (stdout, stderr); a rank's failure fails the test with the first traceback and
    torchrun's summary."""
    proc = launch_torchrun(command, timeout=timeout, nproc=nproc, cwd=cwd)
    stdout, stderr = proc.stdout, proc.stderr
    first = stderr.find("Traceback")
    assert proc.returncode == 0, (f"exit {proc.returncode}: {' '.join(command)}\n{stdout[-3000:]}\n--- first traceback "
                                  f"---\n{stderr[max(first, 0):][:6000]}\n--- end ---\n{stderr[-6000:]}")
    return stdout, stderr


def _forkserver_context():
    """multiprocessing's ``forkserver`` context, its server (one per test process) preloading ``PRELOADED_MODULES``."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOADED_MODULES)
    return ctx


def _fork_server_environ():
    """The environment the fork server starts in, if a process started now starts it: one thread per rank, the repo
    root on its path for the ``tests`` modules it preloads."""
    path = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return _patched_environ({**_WORKER_ENV, "PYTHONPATH": path}, _WORKER_ENV_DEFAULTS)


def start_forked(target: Callable, *args: Any, name: str, stdout: str | None = None, stderr: str | None = None):
    """A started process running ``target(*args)`` (a module-level function), forked from the pools' fork server:
    torch, Thunder and litgpt already imported, one thread; its standard output and error written to the files
    `stdout` and `stderr` where given."""
    ctx = _forkserver_context()
    with _fork_server_environ():
        process = ctx.Process(target=_with_output_in, args=(stdout, stderr, target, *args), name=name, daemon=False)
        process.start()
    return process


def _with_output_in(stdout: str | None, stderr: str | None, target: Callable, *args: Any) -> None:
    """``target(*args)``, file descriptors 1 and 2 written to the files `stdout` and `stderr` (None: as they are)."""
    for fd, path in ((1, stdout), (2, stderr)):
        if path is not None:
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    target(*args)


def _reserve_port() -> tuple[socket.socket, int]:
    """Bind port 0 with SO_REUSEADDR and keep the socket (not listening).

    While it is held, no other bind(0) gets this port, but rank 0's TCPStore
    (which also uses SO_REUSEADDR) can still listen on it.
    """
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s, s.getsockname()[1]


def assert_close(actual, expected, *, rtol: float = 1e-5, atol: float = 1e-6, name: str = "") -> None:
    """``torch.testing.assert_close`` that puts ``name`` (and the rank) in the message."""
    import torch

    prefix = name
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank = f"rank {torch.distributed.get_rank()}"
        prefix = f"{prefix} ({rank})" if prefix else rank
    if prefix:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{prefix}: {m}")
    else:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


@contextlib.contextmanager
def _patched_environ(values: dict[str, str], defaults: dict[str, str]):
    saved = {k: os.environ.get(k) for k in (*values, *defaults)}
    os.environ.update(values)
    for k, v in defaults.items():
        os.environ.setdefault(k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _fn_name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _summary(text: str) -> str:
    """One line for a rank's failure: the exception line of a traceback, else the first line."""
    lines = text.rstrip().splitlines()
    if not lines:
        return "(no details)"
    if lines[0].startswith("Traceback"):
        last_file = max((i for i, line in enumerate(lines) if line.startswith("  File ")), default=0)
        for line in lines[last_file + 1 :]:
            if line and not line.startswith(" "):
                return line[:200]
    return lines[0][:200]


# ----------------------------------------------------------------------------
# worker side
# ----------------------------------------------------------------------------


def _send(conn, obj) -> None:
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _watch_parent(parent_pid: int) -> None:
    # If the parent (the fork server, which leaves with the test process) dies, even by SIGKILL, while this rank is
    # stuck in a collective, don't linger as an orphan.
    while True:
        time.sleep(2.0)
        if os.getppid() != parent_pid:
            os._exit(3)


@contextlib.contextmanager
def _process_defaults_restored(torch):
    """A task leaves the pool's process as it found it: the default dtype and grad mode a task sets (as a test
    body does with ``torch.set_default_dtype``) do not leak into the next test's task on the same rank."""
    dtype, grad = torch.get_default_dtype(), torch.is_grad_enabled()
    try:
        yield
    finally:
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)


def _worker_main(rank: int, world_size: int, port: int, conn, stack_file: str) -> None:
    # The fork server imported torch with these set. (The parent's sys.path, the repo root first, comes with the
    # forkserver start method.)
    os.environ.update(_WORKER_ENV)
    for k, v in _WORKER_ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True, name="watch-parent").start()

    import faulthandler

    stack_fh = open(stack_file, "w")
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stack_fh, all_threads=True)

    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}"
        )
    except BaseException:
        _send(conn, ("ready", None, False, traceback.format_exc()))
        return
    _send(conn, ("ready", None, True, os.getpid()))

    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # parent went away
            break
        kind, task_id = msg[0], msg[1]
        if kind == "exit":
            break
        if kind == "sync":
            try:
                dist.barrier()
                reply = ("sync", task_id, True, None)
            except BaseException:
                reply = ("sync", task_id, False, traceback.format_exc())
        elif kind == "run":
            try:
                fn, args, kwargs = pickle.loads(msg[2])
                with _process_defaults_restored(torch):
                    result = fn(*args, **kwargs)
                try:
                    payload = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
                    reply = ("run", task_id, True, payload)
                except Exception:
                    reply = ("run", task_id, False, "result could not be pickled:\n" + traceback.format_exc())
            except BaseException:
                reply = ("run", task_id, False, traceback.format_exc())
        else:
            reply = (kind, task_id, False, f"unknown command {kind!r}")
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        try:
            _send(conn, reply)
        except (EOFError, OSError):
            break

    with contextlib.suppress(BaseException):
        dist.destroy_process_group()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    # Run the exit handlers, then skip the rest of interpreter teardown (about 1 s with torch loaded).
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    os._exit(0)


# ----------------------------------------------------------------------------
# parent side
# ----------------------------------------------------------------------------


class _Pool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self.procs: list = []
        self.conns: list = []
        self.stack_files: list[str] = []
        self.broken = False
        self._exit_requested = False
        self._task_ids = 0
        last_error = ""
        for _attempt in range(STARTUP_ATTEMPTS):
            try:
                self._start()
                return
            except _StartupError as e:
                last_error = str(e)
                self.kill()
                self.broken = False
        raise RuntimeError(
            f"could not start a gloo pool of {world_size} ranks ({STARTUP_ATTEMPTS} attempts); see the workers' "
            "stderr (a script calling run_ranks needs the `if __name__ == '__main__':` guard that the "
            f"forkserver start method requires); last error:\n{last_error}"
        )

    # -- lifecycle ---------------------------------------------------------

    def _start(self) -> None:
        ctx = _forkserver_context()
        holder, port = _reserve_port()
        self.port = port
        try:
            with _fork_server_environ():
                for rank in range(self.world_size):
                    fd, stack_file = tempfile.mkstemp(prefix=f"dist-rank{rank}-", suffix=".stack")
                    os.close(fd)
                    self.stack_files.append(stack_file)
                    parent_conn, child_conn = ctx.Pipe(duplex=True)
                    p = ctx.Process(
                        target=_worker_main,
                        args=(rank, self.world_size, port, child_conn, stack_file),
                        name=f"dist-w{self.world_size}-r{rank}",
                        daemon=False,  # daemonic processes may not start children
                    )
                    p.start()
                    child_conn.close()
                    self.procs.append(p)
                    self.conns.append(parent_conn)
            replies, errors, pending = self._collect("ready", None, STARTUP_TIMEOUT_S, grace=5.0)
        finally:
            holder.close()
        if errors or pending:
            msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            if pending:
                msg += f"\nranks {sorted(pending)} did not come up within the limit"
            raise _StartupError(msg)

    def kill(self) -> None:
        self.broken = True
        for p in self.procs:
            with contextlib.suppress(Exception):
                if p.is_alive():
                    p.kill()
        self._reap(timeout=10.0)

    def request_exit(self) -> None:
        """Ask idle workers to leave; :meth:`kill` then reaps them (and any that did not)."""
        if not self.broken and not self._exit_requested:
            self._exit_requested = True
            for conn in self.conns:
                with contextlib.suppress(Exception):
                    _send(conn, ("exit", None))

    def shutdown(self) -> None:
        self.request_exit()
        deadline = time.monotonic() + 10.0
        for p in self.procs:
            with contextlib.suppress(Exception):
                p.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def _reap(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            with contextlib.suppress(Exception):
                p.join(max(0.0, deadline - time.monotonic()))
        for conn in self.conns:
            with contextlib.suppress(Exception):
                conn.close()
        for path in self.stack_files:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self.procs, self.conns, self.stack_files = [], [], []

    # -- messaging ---------------------------------------------------------

    def _collect(self, kind: str, task_id, timeout: float, grace: float):
        """Wait for one reply of ``kind`` per rank.

        Returns (replies, errors, pending): ok payloads by rank, failure texts
        by rank, and the ranks that never answered.  Stops ``grace`` seconds
        after the first failure even if ranks are still pending.
        """
        deadline = time.monotonic() + timeout
        pending = set(range(self.world_size))
        replies: dict[int, Any] = {}
        errors: dict[int, str] = {}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            waitables = {}
            for r in pending:
                waitables[self.conns[r]] = r
                waitables[self.procs[r].sentinel] = r
            for ready in mp_connection.wait(list(waitables), timeout=remaining):
                r = waitables[ready]
                if r not in pending:
                    continue
                conn = self.conns[r]
                msg = None
                if conn.poll():
                    try:
                        msg = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        msg = None
                    except Exception:
                        msg = (kind, task_id, False, "reply could not be unpickled:\n" + traceback.format_exc())
                if msg is None:
                    p = self.procs[r]
                    p.join(1.0)
                    errors[r] = f"worker process died (exit code {p.exitcode})"
                    self.broken = True
                elif msg[0] != kind or msg[1] != task_id:
                    errors[r] = f"protocol error: expected {(kind, task_id)}, got {msg[:2]}"
                    self.broken = True
                elif msg[2]:
                    replies[r] = msg[3]
                else:
                    errors[r] = msg[3]
                pending.discard(r)
                if errors:
                    deadline = min(deadline, time.monotonic() + grace)
        return replies, errors, pending

    def dump_stacks(self, ranks) -> dict[int, str]:
        """Python stacks of the given (stuck) ranks, via faulthandler on SIGUSR1."""
        if not hasattr(signal, "SIGUSR1"):
            return {}
        for r in ranks:
            with contextlib.suppress(Exception):
                os.kill(self.procs[r].pid, signal.SIGUSR1)
        time.sleep(0.5)
        stacks = {}
        for r in ranks:
            with contextlib.suppress(OSError):
                with open(self.stack_files[r]) as f:
                    stacks[r] = f.read().strip()
        return stacks

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list:
        try:
            blob = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise TypeError(
                f"run_ranks: cannot pickle {_fn_name(fn)} and its arguments ({e}); fn must be a "
                "module-level function importable by the workers, arguments must be picklable"
            ) from e

        self._task_ids += 1
        task_id = self._task_ids
        what = f"run_ranks({_fn_name(fn)}, world_size={self.world_size})"
        started = time.monotonic()
        try:
            for conn in self.conns:
                _send(conn, ("run", task_id, blob))
            replies, errors, pending = self._collect("run", task_id, timeout, grace=FAILURE_GRACE_S)
        except BaseException:  # e.g. KeyboardInterrupt: state unknown
            self.kill()
            raise

        elapsed = time.monotonic() - started
        if pending:
            stacks = self.dump_stacks(pending)
            self.kill()
            if errors:
                why = f"did not finish within {FAILURE_GRACE_S:g} s after rank {next(iter(errors))} failed"
            else:
                why = f"timed out after {timeout:g} s"
            for r in sorted(pending):
                stack = stacks.get(r) or "(no stack available)"
                errors[r] = f"no answer: {why} (stuck in a collective?); pool killed\nStack:\n{stack}"
        elif errors:
            # Every rank answered: the pool may still be usable. Check that
            # ranks are in lock-step; if not, throw the pool away.
            self._sync(task_id, errors)
        else:
            sync_errors: dict[int, str] = {}
            self._sync(task_id, sync_errors)
            if sync_errors:
                errors.update(sync_errors)

        if errors:
            summary = "; ".join(f"rank {r}: {_summary(tb)}" for r, tb in sorted(errors.items()))
            details = "\n".join(f"---------- rank {r} ----------\n{tb.rstrip()}" for r, tb in sorted(errors.items()))
            raise RanksFailed(f"{what} failed after {elapsed:.1f} s ({summary})\n{details}", errors)

        out = []
        for r in range(self.world_size):
            out.append(pickle.loads(replies[r]))
        return out

    def _sync(self, task_id: int, errors: dict[int, str]) -> None:
        """Barrier on all ranks; on failure record it in ``errors`` and kill the pool."""
        if self.broken:
            self.kill()
            return
        try:
            for conn in self.conns:
                _send(conn, ("sync", task_id))
            _, sync_errors, pending = self._collect("sync", task_id, SYNC_TIMEOUT_S, grace=5.0)
        except BaseException:
            self.kill()
            raise
        if sync_errors or pending:
            stacks = self.dump_stacks(pending) if pending else {}
            self.kill()
            for r, tb in sync_errors.items():
                errors.setdefault(r, f"post-task barrier failed:\n{tb}")
            for r in pending:
                errors.setdefault(
                    r,
                    f"post-task barrier did not complete within {SYNC_TIMEOUT_S:g} s (ranks out of lock-step: "
                    f"mismatched collectives in fn?); pool killed\nStack:\n{stacks.get(r) or '(no stack available)'}",
                )


class _StartupError(Exception):
    pass


_pools: dict[int, _Pool] = {}
_lock = threading.RLock()


def run_ranks(fn: Callable, world_size: int, *args, timeout: float | None = None, **kwargs) -> list:
    """Run fn(*args, **kwargs) on world_size gloo ranks; return each rank's result (rank order).

    ``fn`` must be a module-level function (it is pickled by reference); its
    arguments and return value must be picklable.  ``timeout`` covers running
    ``fn`` (including importing its module in the workers on first use), not
    starting the pool.  If any rank raises, dies or
    does not finish within ``timeout`` seconds, :class:`RanksFailed` (an
    ``AssertionError``) is raised with every rank's traceback (or stack, for
    ranks that were stuck).  The default timeout is THUNDER_TP_TEST_TIMEOUT seconds (300 unless set: raise it
    when the machine is shared with other jobs).
    """
    timeout = float(os.environ.get("THUNDER_TP_TEST_TIMEOUT", 300)) if timeout is None else timeout
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    with _lock:
        pool = _pools.get(world_size)
        if pool is None or pool.broken:
            pool = _Pool(world_size)
            _pools[world_size] = pool
        try:
            return pool.run(fn, args, kwargs, timeout)
        finally:
            if pool.broken:
                _pools.pop(world_size, None)


def shutdown_pools() -> None:
    """Stop all worker pools (they are recreated on next use)."""
    with _lock:
        pools = list(_pools.values())
        _pools.clear()
        for pool in pools:  # let all pools wind down in parallel
            with contextlib.suppress(Exception):
                pool.request_exit()
        for pool in pools:
            with contextlib.suppress(Exception):
                pool.shutdown()


def _pool_pids(world_size: int) -> list[int]:
    """PIDs of the live pool for ``world_size`` (for tests of the harness)."""
    pool = _pools.get(world_size)
    return [p.pid for p in pool.procs] if pool is not None else []


atexit.register(shutdown_pools)
