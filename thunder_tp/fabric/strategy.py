"""ThunderTPStrategy: Lightning Fabric's strategy for thunder_tp, the counterpart of Lightning's ModelParallelStrategy.

    fabric = L.Fabric(devices=4, strategy=ThunderTPStrategy(tensor_parallel_size=2, data_parallel="fsdp"),
                      precision="bf16-true")
    fabric.launch()
    with fabric.init_module(empty_init=True):   # the meta device; each rank materializes only its shards
        model = GPT(config)
    model = fabric.setup(model)                 # thunder.jit with TensorParallel (+ Thunder's DDP/FSDP over dp)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
    fabric.clip_gradients(model, optimizer, max_norm=1.0)   # the whole model's norm, the same on every rank

The world is a (data_parallel x tensor_parallel) mesh, tp-fastest (thunder_tp.init_mesh): each TP group is a set of
consecutive ranks that computes one program over the same batches, and the data is split by the data-parallel
group (`distributed_sampler_kwargs`, litdata's streaming datasets through `process_dataloader`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn as nn
from lightning.fabric.accelerators.accelerator import Accelerator
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.precision.precision import Precision
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import TBroadcast, _BackwardSyncControl
from lightning.fabric.utilities.distributed import (
    ReduceOp,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

import thunder_tp.tools.clipping as clipping
from thunder_tp.data_parallel.mesh import Mesh, init_mesh
from thunder_tp.fabric import checkpoints
from thunder_tp.fabric.data import shard_by_data_parallel
from thunder_tp.fabric.model import (
    ModelOptions,
    jit,
    move_optimizer_to_shards,
    read_parallelize_fn,
    route_state_dicts_to_shards,
    stand_ins,
)
from thunder_tp.fabric.precision import check_precision
from thunder_tp.runtimes.divergence import check_same_tensors
from thunder_tp.transform import TensorParallel

__all__ = ["ThunderTPStrategy"]


class ThunderTPStrategy(ParallelStrategy):
    """Tensor parallelism (thunder_tp) inside Thunder's DDP or FSDP, for Lightning Fabric.

    plan: a dict of styles, "auto", "litgpt" or "hf" (default: the model's family, else "auto").
    parallelize_fn: a `ModelParallelStrategy` parallelize function instead (also as the first argument, as that
    strategy takes it): called with the model and a DeviceMesh of dims ("data_parallel", "tensor_parallel"), its
    `parallelize_module` calls are the plan (recorded, not applied) and its FSDP2 `fully_shard` (composable
    `replicate`) sets data_parallel "fsdp" ("ddp").
    tensor_parallel_size / data_parallel_size: the mesh ("auto": TP over the devices of a node, DP over the nodes;
    one of them given: the other is the world over it). data_parallel: "fsdp" or "ddp" over the data-parallel group.
    sequence_parallel / loss_parallel: options of the family plans. executors: Thunder executors (default
    thunder_tp.executors()). activation_checkpointing_policy: module types whose forward is recomputed in the
    backward (e.g. {litgpt.model.Block}). check_weights: setup compares the full parameters every rank shards and
    all raise where they differ; False for ranks that shard from different sources on purpose.
    example_inputs: (args, kwargs) of a call, for plan="auto".
    accelerator, parallel_devices, cluster_environment, checkpoint_io, precision: Lightning's, as every strategy's.
    tensor_parallel_options: TensorParallel's keyword options, passed on to it and checked by it here: check_inputs,
    check_collectives, overlap, float8_all_gather, ... (thunder_tp.TensorParallel says what each does).
    """

    def __init__(
        self,
        plan: Mapping[str, Any] | Literal["auto", "litgpt", "hf"] | Callable | None = None,
        tensor_parallel_size: int | Literal["auto"] = "auto",
        data_parallel_size: int | Literal["auto"] = "auto",
        data_parallel: Literal["fsdp", "ddp"] = "fsdp",
        sequence_parallel: bool = False,
        loss_parallel: bool = False,
        executors: Sequence | None = None,
        activation_checkpointing_policy: set[type[nn.Module]] | None = None,
        check_weights: bool = True,
        example_inputs: tuple[tuple, dict] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        parallelize_fn: Callable | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        **tensor_parallel_options: Any,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision=precision)
        if callable(plan) and not isinstance(plan, (Mapping, str)):  # ModelParallelStrategy(parallelize_fn)
            plan, parallelize_fn = None, _one_of(parallelize_fn, plan)
        if data_parallel not in ("fsdp", "ddp"):
            raise ValueError(f'ThunderTPStrategy: data_parallel must be "fsdp" or "ddp", got {data_parallel!r}')
        for name, size in (("tensor_parallel_size", tensor_parallel_size), ("data_parallel_size", data_parallel_size)):
            if size != "auto" and (not isinstance(size, int) or size < 1):
                raise ValueError(f'ThunderTPStrategy: {name} must be a positive int or "auto", got {size!r}')
        _check_tensor_parallel_options(tensor_parallel_options, check_weights)
        if parallelize_fn is not None and plan is not None:
            raise ValueError("ThunderTPStrategy: give plan= or parallelize_fn=, not both (the parallelize_fn's "
                             "parallelize_module calls are the plan)")
        self.options = ModelOptions(
            plan=plan, parallelize_fn=parallelize_fn, data_parallel=data_parallel,
            sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
            executors=executors, activation_checkpointing=frozenset(activation_checkpointing_policy or ()),
            check_weights=check_weights, example_inputs=example_inputs, tensor_parallel=tensor_parallel_options,
        )
        self._sizes = (data_parallel_size, tensor_parallel_size)
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._mesh: Mesh | None = None
        #: every tensor an optimizer may hold for a parameter of a model set up here -> (the jitted model, its name)
        self._owners: WeakIdKeyDictionary = WeakIdKeyDictionary()
        #: the jitted modules this strategy set up (fabric.setup returns each wrapped in Fabric's module)
        self.models: list[nn.Module] = []
        self._backward_sync_control = _DataParallelSyncControl(self)

    # --- the world -------------------------------------------------------------------------------------------

    @property
    def mesh(self) -> Mesh:
        """The (data_parallel x tensor_parallel) mesh of this rank (after fabric.launch)."""
        if self._mesh is None:
            raise RuntimeError("ThunderTPStrategy: the mesh exists once the processes are launched (fabric.launch())")
        return self._mesh

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        """Every rank of a TP group gets the same batches: the data is split by the data-parallel group (with one
        data-parallel rank, not at all: the loader's own sampler, as on one device)."""
        return {"num_replicas": self.mesh.dp, "rank": self.mesh.dp_rank} if self.mesh.dp > 1 else None

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        check_precision(self.precision)
        self._set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        assert self.cluster_environment is not None
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
        if dist.get_world_size() != self.world_size:
            raise RuntimeError(
                f"ThunderTPStrategy: the process group has {dist.get_world_size()} ranks, Fabric expects "
                f"{self.world_size} (devices x num_nodes); launch as many processes as devices"
            )
        dp, tp = self._sizes
        if dp == "auto" and tp == "auto":
            dp, tp = self.num_nodes, self.num_processes
        self._mesh = init_mesh(dp=None if dp == "auto" else dp, tp=None if tp == "auto" else tp)
        rank_zero_info(f"ThunderTPStrategy: data_parallel={self._mesh.dp} x tensor_parallel={self._mesh.tp}")

    def _set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # --- the model and the optimizer ---------------------------------------------------------------------------

    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """`empty_init=True`: the meta device (each rank materializes its shards at setup); else the root device."""
        stack = ExitStack()
        stack.enter_context(torch.device("meta") if empty_init else self.root_device)
        stack.enter_context(self.precision.module_init_context())
        return stack

    def module_to_device(self, module: nn.Module) -> None:
        """Nothing: setup_module places each rank's shards."""

    def setup_module(self, module: nn.Module):
        """`module` jitted with thunder_tp over the mesh (a torch.compile'd module's original is used), once every rank
        is found to shard the same full parameters (else every rank raises, naming them and the likely cause)."""
        module = getattr(module, "_orig_mod", module)
        if self.options.parallelize_fn is not None:
            self.options = read_parallelize_fn(module, self.options, self._lightning_device_mesh())
        if not any(t.is_meta for t in (*module.parameters(), *module.buffers())):
            module.to(self.root_device)
        jitted, checksums = jit(module, self.options, self.mesh, self.root_device)
        if self.options.check_weights:
            check_same_tensors(checksums, dist.group.WORLD, "ThunderTPStrategy setup", _DIFFERENT_INITIALIZATION)
        for tensor, name in stand_ins(jitted, self.root_device):
            self._owners[tensor] = (jitted, name)
        route_state_dicts_to_shards(jitted)
        self.models.append(jitted)
        return jitted

    def _lightning_device_mesh(self):
        """This mesh as the DeviceMesh ModelParallelStrategy gives a parallelize_fn: dims ("data_parallel",
        "tensor_parallel") over the mesh's own groups."""
        from torch.distributed.device_mesh import DeviceMesh

        ranks = torch.arange(self.mesh.world_size).view(self.mesh.dp, self.mesh.tp)
        return DeviceMesh.from_group([self.mesh.dp_group, self.mesh.tp_group], self.root_device.type, mesh=ranks,
                                     mesh_dim_names=("data_parallel", "tensor_parallel"))

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer of the model's parameters (built before fabric.setup or after it) steps the shards instead,
        its param groups' options and state kept."""
        move_optimizer_to_shards(optimizer, self._owners)
        return optimizer

    def process_dataloader(self, dataloader):
        """litdata's streaming datasets shard by the data-parallel group, like the sampler of map-style ones."""
        if shard_by_data_parallel(getattr(dataloader, "dataset", None), self.mesh):
            rank_zero_info("ThunderTPStrategy: litdata's StreamingDataset shards by the data-parallel group "
                           f"({self.mesh.dp} ranks), so every rank of a TP group streams the same batches")
        return dataloader

    def clip_gradients_norm(self, module: nn.Module, optimizer, max_norm: float, norm_type: float = 2.0,
                            error_if_nonfinite: bool = True) -> Tensor:
        """The whole model's norm, once across the TP and data-parallel groups (thunder_tp.clip_grad_norm_)."""
        self.precision.unscale_gradients(optimizer)
        return clipping.clip_grad_norm_(module, max_norm, norm_type, error_if_nonfinite)

    def clip_gradients_value(self, module: nn.Module, optimizer, clip_val: float) -> None:
        self.precision.unscale_gradients(optimizer)
        clipping.clip_grad_value_(module, clip_val)

    # --- collectives over the world -----------------------------------------------------------------------------

    def all_reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not dist.is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    # --- checkpoints --------------------------------------------------------------------------------------------

    def save_checkpoint(self, path, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        """A sharded DCP directory at `path` (loadable at any other TP size), or with `filter` one full file."""
        if storage_options is not None:
            raise TypeError("ThunderTPStrategy.save_checkpoint(..., storage_options=...) is not supported: it saves "
                            "through torch.distributed.checkpoint, not a CheckpointIO plugin")
        checkpoints.save(Path(self.broadcast(str(path))), state, filter, self.global_rank)

    def load_checkpoint(self, path, state: Any = None, strict: bool = True, weights_only: bool | None = None) -> dict:
        """Restore `state` from a directory that save_checkpoint wrote (at any TP size), or a module from a plain
        state-dict file (fabric.load_raw: each rank reads its slices)."""
        if not state:
            raise ValueError("ThunderTPStrategy.load_checkpoint needs the state to restore: "
                             "fabric.load(path, {'model': model, 'optimizer': optimizer, ...})")
        return checkpoints.load(Path(self.broadcast(str(path))), state, strict)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register("thunder_tp", cls, description="thunder_tp tensor parallelism (+ Thunder DDP/FSDP)")


#: the keyword options of TensorParallel that the strategy passes on (it sets example_inputs and check_weights itself)
_TENSOR_PARALLEL_OPTIONS = tuple(name for name, p in inspect.signature(TensorParallel).parameters.items()
                                 if p.kind is p.KEYWORD_ONLY and name not in ("example_inputs", "check_weights"))


def _check_tensor_parallel_options(options: Mapping[str, Any], check_weights: bool) -> None:
    """Raise unless `options` are TensorParallel keyword options whose values TensorParallel takes (it checks them)."""
    unknown = sorted(set(options) - set(_TENSOR_PARALLEL_OPTIONS))
    if unknown:
        raise TypeError(f"ThunderTPStrategy got unexpected keyword arguments {unknown}: besides its own options it "
                        f"takes TensorParallel's {list(_TENSOR_PARALLEL_OPTIONS)}")
    TensorParallel(check_weights=check_weights, **options)


def _one_of(parallelize_fn: Callable | None, positional: Callable) -> Callable:
    if parallelize_fn is not None:
        raise ValueError("ThunderTPStrategy: a parallelize function given twice (first argument and parallelize_fn=)")
    return positional


_DIFFERENT_INITIALIZATION = (
    "Every rank shards its own full parameters, so they must be equal on every rank (every rank of a TP group holds "
    "a copy of the replicated ones, and a data-parallel replica of them all). Most likely the ranks were seeded "
    "differently before the model was built (fabric.seed_everything(seed + fabric.global_rank), a seed from the "
    "rank): seed every rank alike before building the model (fabric.seed_everything(seed)). The ranks of a TP group "
    "must also draw the same random numbers inside the model; for randomness per data-parallel replica, reseed with "
    "seed + strategy.mesh.dp_rank after fabric.setup. (Weights loaded on some ranks only differ too: load them on "
    "every rank, or with fabric.load_raw after setup.) ThunderTPStrategy(check_weights=False) if the ranks shard from "
    "different sources on purpose. Nothing was set up."
)


class _DataParallelSyncControl(_BackwardSyncControl):
    """Gradient accumulation: under DDP the micro-batches inside `no_backward_sync` skip the all_reduce and the first
    synchronized backward after them adds their average; under FSDP and TP alone every backward synchronizes (Thunder's
    FSDP reduce-scatters each backward's gradients; TP's collectives are part of the program)."""

    def __init__(self, strategy: ThunderTPStrategy):
        self.strategy = strategy
        self.pending = False  # gradients accumulated without the all_reduce

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        mesh = self.strategy.mesh
        if mesh.dp == 1 or self.strategy.options.data_parallel != "ddp":
            return nullcontext()
        return self._skipping(module, mesh) if enabled else self._catching_up(module, mesh)

    @contextmanager
    def _skipping(self, module: nn.Module, mesh: Mesh) -> Iterator[None]:
        from thunder.distributed import skip_data_parallel_grad_sync

        self.pending = True
        with skip_data_parallel_grad_sync():
            yield

    @contextmanager
    def _catching_up(self, module: nn.Module, mesh: Mesh) -> Iterator[None]:
        if not self.pending:
            yield
            return
        params = [p for p in module.parameters() if p.grad is not None]
        local = [p.grad for p in params]
        for p in params:
            p.grad = None
        yield
        self.pending = False
        for p, g in zip(params, local, strict=True):
            dist.all_reduce(g, group=mesh.dp_group)
            g.div_(mesh.dp)
            p.grad = g if p.grad is None else p.grad.add_(g)
