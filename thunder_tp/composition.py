"""Composition of TensorParallel with Thunder's data-parallel transforms (DDPTransform / FSDPTransform) in 2-D."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from thunder_tp.thunder_internals.private import applied_transforms

__all__ = ["check_composition", "check_data_parallel_order", "check_orthogonal_groups"]


def _data_parallel_transform_types() -> tuple[type, ...]:
    from thunder.distributed.transforms.ddp_v2 import DDPTransform
    from thunder.distributed.transforms.fsdp_v2 import FSDPTransform

    return DDPTransform, FSDPTransform


def check_data_parallel_order(model) -> None:
    """Raise if a data-parallel transform (DDP/FSDP) was applied to `model` before TensorParallel.

    Thunder applies transforms in list order and records the applied ones (`thunder.list_transforms`), so a
    DDPTransform / FSDPTransform there came first. DP first cannot work: FSDP would shard the full weight on
    dim 0 and TP would then cut its shard out of the FSDP shard; DDP would record full parameter shapes and
    its trace pass would synchronize the full-size parameters before TP gives them their local shapes.
    (The `use_ddp` / `use_fsdp` flags Thunder leaves on the original module are not read: they outlive the
    jit that set them, so a later `thunder.jit(model, transforms=[TP, DDP])` of the same module would fail.)
    """
    earlier = [t for t in applied_transforms(model) if isinstance(t, _data_parallel_transform_types())]
    if earlier:
        raise ValueError(
            f"thunder_tp.TensorParallel must be applied before {type(earlier[0]).__name__}: list it first, e.g. "
            "thunder.jit(model, transforms=[TensorParallel(plan, process_group=mesh.tp_group), "
            "DDPTransform(process_group=mesh.dp_group, ...) or FSDPTransform(..., process_group=mesh.dp_group)]) "
            "(or use thunder_tp.parallelize(model, plan, mesh, data_parallel=...)). Data parallelism first would "
            "shard or synchronize the full parameters before TP splits them"
        )


def check_composition(tp_transform, model) -> None:
    """Called by TensorParallel.transform_module: no DDP/FSDP before it, and later ones on groups orthogonal to TP's."""
    check_data_parallel_order(model)
    import thunder

    cd = thunder.compile_data(model)
    transforms = list(getattr(cd, "transforms", None) or ())
    later = transforms[transforms.index(tp_transform) + 1 :] if tp_transform in transforms else []
    for t in later:
        if isinstance(t, _data_parallel_transform_types()):
            check_orthogonal_groups(tp_transform.tp.group, t.process_group, type(t).__name__)


def check_orthogonal_groups(tp_group: dist.ProcessGroup, dp_group: Any, what: str) -> None:
    """The tp group and a data-parallel group may share only this rank (they are rows and columns of a mesh)."""
    if dp_group is None:
        dp_group = dist.group.WORLD
    tp_ranks = set(dist.get_process_group_ranks(tp_group))
    dp_ranks = set(dist.get_process_group_ranks(dp_group))
    if len(tp_ranks & dp_ranks) > 1:
        raise ValueError(
            f"thunder_tp: the TP group (ranks {sorted(tp_ranks)}) and the process group of {what} (ranks "
            f"{sorted(dp_ranks)}) overlap in more than this rank; 2-D parallelism needs orthogonal groups: use "
            "mesh = thunder_tp.init_mesh(dp=..., tp=...) and pass mesh.tp_group to TensorParallel and mesh.dp_group "
            f"to {what}"
        )
