"""2-D parallelism: a (dp x tp) mesh of process groups, and TP inside Thunder's DDP / FSDP.

    mesh = thunder_tp.init_mesh(dp=2, tp=2)      # or init_mesh(torch DeviceMesh with dims ("dp", "tp"))
    jm = thunder.jit(model, executors=thunder_tp.executors(), transforms=[
        TensorParallel(plan, process_group=mesh.tp_group),
        DDPTransform(process_group=mesh.dp_group, bucket_size_in_mb=25.0, broadcast_from=None),
    ])
    # or, equivalently:
    jm = thunder_tp.parallelize(model, plan, mesh, data_parallel="ddp")

Ranks are laid out tp-fastest, as in Megatron-LM and torchtitan: global rank = dp_rank * tp + tp_rank, so
the TP groups are consecutive ranks ([0, 1], [2, 3] for dp=2, tp=2) and the DP groups strided ([0, 2], [1, 3]).

Composition: TensorParallel must come before DDPTransform / FSDPTransform in `transforms=`. TP shards each
parameter over the tp group first; DDP then replicates that shard over the dp group (its grads are averaged
over dp), FSDP shards it further on dim 0 over the dp group (all_gather before use, reduce_scatter of grads).
The trace hooks run in the same order, so TP rewrites the logical program to local TP shapes and DP sees a
program on TP shards, exactly as it would see a single-device program.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from thunder_tp.execution.executor import executors as default_executors
from thunder_tp.transform import TensorParallel

__all__ = ["Mesh", "init_mesh", "parallelize"]

_DP_NAMES = ("dp", "data_parallel", "dp_shard", "dp_replicate")
_TP_NAMES = ("tp", "tensor_parallel", "model_parallel")


@dataclass(frozen=True)
class Mesh:
    """A (dp x tp) layout of the world's ranks, tp-fastest, with this rank's groups.

    `tp_group` / `dp_group` are the torch ProcessGroups this rank belongs to; `tp_ranks` / `dp_ranks` their
    members (global ranks); `tp_rank` / `dp_rank` this rank's position in each.
    """

    dp: int
    tp: int
    dp_group: dist.ProcessGroup = field(repr=False)
    tp_group: dist.ProcessGroup = field(repr=False)
    dp_rank: int
    tp_rank: int
    dp_ranks: tuple[int, ...]
    tp_ranks: tuple[int, ...]
    device_mesh: Any = field(default=None, repr=False, compare=False)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    @property
    def rank(self) -> int:
        """This rank in the world."""
        return self.dp_rank * self.tp + self.tp_rank


def init_mesh(dp: int | Any | None = None, tp: int | None = None, *, device_mesh: Any = None) -> Mesh:
    """Create the process groups of a (dp x tp) mesh over the default group; every rank must call this.

    `dp` / `tp`: sizes; one may be omitted and is then world_size // other. Instead of sizes, a torch
    `DeviceMesh` may be given (positionally or as `device_mesh=`): 2-D, dims named ("dp", "tp") in any
    order, or unnamed with dp first; its groups are used as they are.

    All TP groups are created first, then all DP groups, each in increasing rank order, on every rank (torch
    requires every process to enter `new_group` for every group, in the same order).
    """
    if device_mesh is None and _is_device_mesh(dp):
        device_mesh, dp = dp, None
    _require_initialized()
    if device_mesh is not None:
        if dp is not None or tp is not None:
            raise ValueError("thunder_tp.init_mesh: give either a DeviceMesh or the sizes dp=/tp=, not both")
        return _from_device_mesh(device_mesh)
    world = dist.get_world_size()
    dp, tp = _sizes(dp, tp, world)
    tp_groups = [list(range(d * tp, (d + 1) * tp)) for d in range(dp)]
    dp_groups = [list(range(t, world, tp)) for t in range(tp)]
    rank = dist.get_rank()
    mine: dict[str, dist.ProcessGroup] = {}
    for kind, groups in (("tp", tp_groups), ("dp", dp_groups)):
        for ranks in groups:
            group = dist.new_group(ranks)  # collective over the world: every rank creates every group
            if rank in ranks:
                mine[kind] = group
    return Mesh(
        dp=dp, tp=tp, dp_group=mine["dp"], tp_group=mine["tp"], dp_rank=rank // tp, tp_rank=rank % tp,
        dp_ranks=tuple(dp_groups[rank % tp]), tp_ranks=tuple(tp_groups[rank // tp]),
    )


def _require_initialized() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "thunder_tp.init_mesh needs an initialized torch.distributed default group: call "
            "torch.distributed.init_process_group(...) (e.g. run under torchrun) first"
        )


def _sizes(dp: Any, tp: Any, world: int) -> tuple[int, int]:
    for name, value in (("dp", dp), ("tp", tp)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"thunder_tp.init_mesh: {name} must be a positive int, got {value!r}")
    if dp is None and tp is None:
        raise ValueError(
            f"thunder_tp.init_mesh: give tp= (and/or dp=); e.g. init_mesh(dp={max(world // 2, 1)}, tp=2) for a "
            f"world of {world} ranks"
        )
    if dp is None or tp is None:
        name, given = ("dp", dp) if tp is None else ("tp", tp)
        if world % given:
            raise ValueError(
                f"thunder_tp.init_mesh: world size {world} is not divisible by {name}={given}; choose a {name} that "
                f"divides {world} (e.g. {_divisors(world)})"
            )
        dp, tp = (given, world // given) if tp is None else (world // given, given)
    if dp * tp != world:
        hint = (f"dp={world // tp}, tp={tp}" if world % tp == 0
                else f"a tp that divides {world} (e.g. {_divisors(world)})")
        raise ValueError(
            f"thunder_tp.init_mesh: dp * tp = {dp} * {tp} = {dp * tp} does not match the world size {world}; use {hint}"
        )
    return dp, tp


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _is_device_mesh(obj: Any) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(obj, DeviceMesh)


def _from_device_mesh(device_mesh: Any) -> Mesh:
    if not _is_device_mesh(device_mesh):
        raise TypeError(f"thunder_tp.init_mesh: expected a torch DeviceMesh, got {type(device_mesh).__name__}")
    if device_mesh.ndim != 2:
        raise ValueError(
            f"thunder_tp.init_mesh: the DeviceMesh must be 2-D (dp, tp), got {device_mesh.ndim}-D with shape "
            f"{tuple(device_mesh.mesh.shape)}; for 1-D use init_mesh(dp=..., tp=...) with dp=1 or tp=1"
        )
    names = device_mesh.mesh_dim_names
    if names is None:
        dp_dim, tp_dim = 0, 1
    else:
        dp_dim = next((i for i, n in enumerate(names) if n in _DP_NAMES), None)
        tp_dim = next((i for i, n in enumerate(names) if n in _TP_NAMES), None)
        if dp_dim is None or tp_dim is None or dp_dim == tp_dim:
            raise ValueError(
                f"thunder_tp.init_mesh: cannot tell the dp and tp dims of a DeviceMesh with dims {names}; name them "
                '("dp", "tp"), e.g. init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))'
            )
    ranks = device_mesh.mesh.permute(dp_dim, tp_dim)  # [dp][tp] -> global rank
    coordinate = device_mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(f"thunder_tp.init_mesh: rank {dist.get_rank()} is not part of the DeviceMesh {device_mesh}")
    dp_rank, tp_rank = coordinate[dp_dim], coordinate[tp_dim]
    return Mesh(
        dp=ranks.shape[0], tp=ranks.shape[1],
        dp_group=device_mesh.get_group(dp_dim), tp_group=device_mesh.get_group(tp_dim),
        dp_rank=dp_rank, tp_rank=tp_rank,
        dp_ranks=tuple(ranks[:, tp_rank].tolist()), tp_ranks=tuple(ranks[dp_rank].tolist()),
        device_mesh=device_mesh,
    )


# --- one-call helper --------------------------------------------------------------------------------


def parallelize(
    model: torch.nn.Module,
    plan: Mapping[str, Any] | None,
    mesh: Mesh,
    data_parallel: Literal["ddp", "fsdp"] | None = None,
    *,
    executors: Iterable | None = None,
    bucket_size_in_mb: float = 25.0,
    fsdp_device: torch.device | None = None,
    transforms: Iterable = (),
    **jit_kwargs,
):
    """`thunder.jit(model)` with TP over `mesh.tp_group`, then DDP or FSDP over `mesh.dp_group`.

    data_parallel: "ddp" (replicate TP shards over dp, average grads), "fsdp" (shard TP shards over dp on
    dim 0), or None (TP only; with dp > 1 every dp rank then trains independently). `transforms` are
    appended after the parallel ones (e.g. MaterializationTransform). Returns the ThunderModule.
    """
    import thunder

    if not isinstance(mesh, Mesh):
        raise TypeError(f"thunder_tp.parallelize: mesh must come from thunder_tp.init_mesh, got {type(mesh).__name__}")
    chain: list = [TensorParallel(plan, process_group=mesh.tp_group)]
    if data_parallel == "ddp":
        from thunder.distributed.transforms.ddp_v2 import DDPTransform

        chain.append(DDPTransform(process_group=mesh.dp_group, bucket_size_in_mb=bucket_size_in_mb,
                                  broadcast_from=None))
    elif data_parallel == "fsdp":
        from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

        chain.append(FSDPTransform(device=fsdp_device or _model_device(model), process_group=mesh.dp_group))
    elif data_parallel is not None:
        raise ValueError(f"thunder_tp.parallelize: data_parallel must be 'ddp', 'fsdp' or None, got {data_parallel!r}")
    chain += list(transforms)
    return thunder.jit(
        model, executors=list(executors) if executors is not None else default_executors(), transforms=chain,
        **jit_kwargs
    )


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
