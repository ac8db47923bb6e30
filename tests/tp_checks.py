"""Helpers shared by the TP tests: run a model single-device and under TP on the same inputs, compare."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import thunder
import torch
import torch.distributed as dist

import thunder_tp
from thunder_tp.collectives import comm_executor
from thunder_tp.execution.complex_grads import complex_grads_executor
from thunder_tp.layouts import REPLICATE, Layout
from thunder_tp.pieces import shard_tensor

#: complex arithmetic's grads, the comm executor and Thunder's defaults: no Inductor compile, so correctness tests
#: stay fast on CPU; the fusion executor is exercised by tests/test_executor.py and the TP tests that pass
#: thunder_tp.executors().
FAST_EXECUTORS = [complex_grads_executor, comm_executor, *thunder.get_default_executors()]


def regions_uncompiled():
    """thunder_tp.executors()' fusion regions run op by op (torch.compile's "force_eager" stance): the same program,
    schedule and regions, without Inductor's compilation; for tests of the program, not of Inductor's kernels."""
    return torch.compiler.set_stance("force_eager")


def rank_and_size(group=None) -> tuple[int, int]:
    """This rank and the group size."""
    return dist.get_rank(group), dist.get_world_size(group)


def collective_counts(trace) -> dict[str, int]:
    """How many of each collective a final trace issues (top-level torchex prims and thunder_tp symbols)."""
    from thunder_tp.tools.debug import collective_calls

    counts: dict[str, int] = {}
    for call in collective_calls(trace):
        counts[call["kind"]] = counts.get(call["kind"], 0) + 1
    return counts


def assert_close_scaled(actual, expected, *, rtol: float, atol: float, what: str) -> None:
    """assert_close with `atol` relative to the expected tensor's largest magnitude (so tiny grads are not waved
    through by an absolute floor: a 1% error in a grad whose entries are ~1e-3 fails)."""
    scale = (expected.detach().abs().max().item() if expected.numel() else 0.0) or 1.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol * scale, msg=lambda m: f"{what}: {m}")


def compare_with_single_device(
    make_model: Callable[[], torch.nn.Module],
    make_inputs: Callable[[], tuple],
    transform: thunder_tp.TensorParallel,
    *,
    grad: bool = True,
    rtol: float = 1e-5,
    atol: float = 1e-5,
    executors=None,
    inspect: Callable[[torch.nn.Module], Any] | None = None,
) -> dict:
    """Check output, input grads and every parameter grad (shards vs chunks of full grads); return traces info
    (and, under "inspected", what ``inspect`` returns for the jitted module after its backward)."""
    rank, size = rank_and_size(transform.process_group)
    torch.manual_seed(0)
    reference = make_model()
    torch.manual_seed(0)
    model = make_model()
    model.load_state_dict(reference.state_dict())
    inputs = make_inputs()
    ref_inputs = [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
                  for x in inputs]
    jm = thunder.jit(model, transforms=[transform], executors=executors or FAST_EXECUTORS)
    with torch.set_grad_enabled(grad):
        expected = reference(*ref_inputs)
        actual = jm(*inputs)
    assert_close_scaled(actual, expected, rtol=rtol, atol=atol, what="output")
    info = {"forward": collective_counts(thunder.last_traces(jm)[-1])}
    if not grad:
        return info
    torch.manual_seed(1)
    cotangent = torch.randn_like(expected)
    (expected * cotangent).sum().backward()
    (actual * cotangent).sum().backward()
    info["backward"] = collective_counts(thunder.last_backward_traces(jm)[-1])
    for x, r in zip(inputs, ref_inputs, strict=True):
        if isinstance(x, torch.Tensor) and x.requires_grad:
            assert_close_scaled(x.grad, r.grad, rtol=rtol, atol=atol, what="input grad")
    assert_grads_are_shards(reference, jm, transform.parameter_layouts, rank, size, rtol=rtol, atol=atol)
    if inspect is not None:
        info["inspected"] = inspect(jm)
    return info


def assert_grads_are_shards(
    reference: torch.nn.Module,
    jm: torch.nn.Module,
    layouts: Mapping[str, Layout],
    rank: int,
    size: int,
    *,
    rtol: float,
    atol: float,
    what: str = "",
    parameters: bool = False,
) -> None:
    """Every parameter's grad on this rank of `size` is its shard (`layouts`, Replicate where absent) of the grad of
    the single-device `reference`; a grad missing on one side only fails (a frozen parameter has none on both).
    parameters=True: the parameters themselves (after steps)."""
    for name, label, full, local in _full_and_local(reference, jm, parameters, what):
        _assert_shard(local, full, layouts.get(name, REPLICATE), rank, size, rtol=rtol, atol=atol, what=label)


def assert_simulated_grads_are_shards(
    reference: torch.nn.Module,
    jm: torch.nn.Module,
    layouts: Mapping[str, Layout],
    world: int,
    *,
    rtol: float,
    atol: float,
    what: str = "",
    parameters: bool = False,
) -> None:
    """assert_grads_are_shards on every rank of a thunder_tp.simulate run of `world` ranks (each rank's piece)."""
    from thunder_tp import per_rank

    for name, label, full, local in _full_and_local(reference, jm, parameters, what):
        if full is None and local is None:  # frozen alike
            continue
        assert local is not None, f"{label}: none under TP"
        pieces = per_rank(local)
        assert sorted(pieces) == list(range(world)), f"{label}: simulated ranks {sorted(pieces)}"
        for rank, piece in pieces.items():
            _assert_shard(piece, full, layouts.get(name, REPLICATE), rank, world, rtol=rtol, atol=atol,
                          what=f"{label} on simulated rank {rank}")


def _full_and_local(
    reference: torch.nn.Module, jm: torch.nn.Module, parameters: bool, what: str
) -> Iterator[tuple[str, str, torch.Tensor | None, torch.Tensor | None]]:
    """(name, label for messages, single-device tensor, TP tensor) per parameter: their grads, or with `parameters`
    the values."""
    prefix = f"{what} " if what else ""
    for name, p in reference.named_parameters():
        local = jm.get_parameter(name)
        if parameters:
            yield name, f"{prefix}parameter {name}", p.detach(), local
        else:
            yield name, f"{prefix}grad of {name}", p.grad, local.grad


def _assert_shard(local, full, layout: Layout, rank: int, size: int, *, rtol: float, atol: float, what: str) -> None:
    if full is None and local is None:  # a frozen parameter: no grad on either side
        return
    assert full is not None, f"{what}: none on the single-device model"
    assert local is not None, f"{what}: none under TP"
    assert_close_scaled(local, shard_tensor(full, layout, rank, size), rtol=rtol, atol=atol, what=what)
