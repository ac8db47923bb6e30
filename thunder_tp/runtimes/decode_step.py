"""A decode step whose host cost does not grow with the model: a jitted module's call with its tensors bound once.

Each call of a jitted module runs Thunder's prologue, which checks the metadata of every parameter and buffer before
the computation runs: host work that grows with every layer, repeated for every token. A ``DecodeStep`` makes its
first call through the module (Thunder compiles, with thunder_tp's checks on every rank), then keeps the computation
Thunder chose and the tensors its prologue unpacked. Later calls check and pass only their own arguments (token ids,
positions): parameters and KV caches are the module's own tensors, bound once, so the cache writes land in the
module's caches, without copies. How the bound computation runs is the strategy:

- ``"bound"``: Thunder's computation as compiled (its fusion regions, its collectives), without the prologue;
- ``"compiled"``: the whole step as one program compiled by torch.compile (``runtimes/whole_step.py``): one
  guarded call instead of one per fusion region and per collective;
- ``"graph"`` (CUDA): Thunder's computation captured as one CUDA graph and replayed (``runtimes/cuda_graphs.py``);
  over a group whose collectives a graph cannot hold (gloo), one graph per stretch between collectives.

Arguments must keep the first call's shapes, dtypes and devices (and its other values): a step per shape, as Thunder
has a program per shape. The tensors the module holds must stay the same objects (written in place, as a KV cache
and its ``reset_parameters`` do); after replacing them (a new ``set_kv_cache``), make a new step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from thunder.core.module import ThunderModule
from thunder.core.trace import TraceCtx

from thunder_tp.collectives.run_mode import ranks_of
from thunder_tp.runtimes.cuda_graphs import CapturedCall, capturable, split_at_communication
from thunder_tp.runtimes.whole_step import compiled_whole
from thunder_tp.thunder_internals.computation import computation_and_inputs
from thunder_tp.thunder_internals.torch_pytree import tree_map

__all__ = ["STRATEGIES", "DecodeStep", "Strategy"]

Strategy = Literal["bound", "compiled", "graph"]
STRATEGIES: tuple[str, ...] = ("bound", "compiled", "graph")


@dataclass(frozen=True)
class _TensorArgument:
    """What a tensor argument must be on every call: the first call's shape, dtype and device."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    def check(self, value: Any, name: str) -> None:
        if not isinstance(value, torch.Tensor) or (value.shape, value.dtype, value.device) != (
                self.shape, self.dtype, self.device):
            raise ValueError(f"thunder_tp.DecodeStep: {name} is {_described(value)}, but this step runs "
                             f"{tuple(self.shape)} {self.dtype} tensors on {self.device}: make a step per shape "
                             "(thunder_tp.generate keeps one per batch size and bucketed length)")


@dataclass(frozen=True)
class _PlainArgument:
    """A non-tensor argument: part of the program Thunder compiled, so the same value on every call."""

    value: Any

    def check(self, value: Any, name: str) -> None:
        if type(value) is not type(self.value) or value != self.value:
            raise ValueError(f"thunder_tp.DecodeStep: {name} is {value!r}, but this step was compiled for "
                             f"{self.value!r}: make a step per value")


def _described(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {tuple(value.shape)} {value.dtype} tensor on {value.device}"
    return repr(value)


class DecodeStep:
    """``module(*args, **kwargs)`` for calls like the first one, with the module's tensors bound once; see the
    module doc. ``module`` is a ``thunder.jit``-ed module (TP or not); call the step without autograd
    (``torch.no_grad()`` or ``torch.inference_mode()``)."""

    def __init__(self, module: ThunderModule, strategy: Strategy = "bound"):
        if not isinstance(module, ThunderModule):
            raise TypeError(f"thunder_tp.DecodeStep: expected a thunder.jit-ed module, got {type(module).__name__}")
        if strategy not in STRATEGIES:
            raise ValueError(f"thunder_tp.DecodeStep: unknown strategy {strategy!r}; expected one of {STRATEGIES}")
        if strategy == "graph" and not torch.cuda.is_available():
            raise RuntimeError("thunder_tp.DecodeStep: strategy='graph' replays CUDA graphs, but CUDA is not "
                               "available; use 'compiled' or 'bound'")
        self.module, self.strategy = module, strategy
        self._expected: list[_TensorArgument | _PlainArgument] = []
        self._keywords: tuple[str, ...] = ()
        self._names: list[str] = []
        self._slots: list[tuple[int, list[int]]] = []  # (argument position, its positions among the inputs)
        self._inputs: list = []
        self._program: Callable[..., Any] | None = None
        self._epilogue: Callable[..., Any] | None = None
        self.trace: TraceCtx | None = None  # the computation Thunder compiled for the first call


    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The module's output for these arguments (the first call binds; later calls check only the arguments)."""
        if torch.is_grad_enabled():
            raise RuntimeError("thunder_tp.DecodeStep runs without autograd: call it under torch.no_grad() or "
                               "torch.inference_mode()")
        if self._program is None:
            return self._bind(args, kwargs)
        values = self._checked(args, kwargs)
        if self.strategy == "graph":
            for position, indices in self._slots:
                self._inputs[indices[0]].copy_(values[position])
            return _cloned(self._run())
        for position, indices in self._slots:
            for i in indices:
                self._inputs[i] = values[position]
        return self._run()

    def _run(self) -> Any:
        """The bound program on the bound inputs, then Thunder's epilogue."""
        return self._epilogue(*self._program(*self._inputs))

    def _checked(self, args: tuple, kwargs: dict) -> tuple:
        """The call's argument values in the bound order, each checked against the first call's."""
        if len(args) != len(self._names) - len(self._keywords) or kwargs.keys() != set(self._keywords):
            raise ValueError(f"thunder_tp.DecodeStep: called with {len(args)} positional arguments and keywords "
                             f"{sorted(kwargs)}, but bound to {len(self._names) - len(self._keywords)} and "
                             f"{sorted(self._keywords)}")
        values = (*args, *(kwargs[k] for k in self._keywords))
        for name, value, expected in zip(self._names, values, self._expected, strict=True):
            expected.check(value, name)
        return values

    def _bind(self, args: tuple, kwargs: dict) -> Any:
        """Run the call through the module, keep its computation and inputs, and prepare the strategy's program."""
        if self.strategy != "bound" and ranks_of().one_trace_for_all:
            raise RuntimeError(f"thunder_tp.DecodeStep: strategy={self.strategy!r} cannot run thunder_tp.simulate's "
                               "LocalTensor programs; use 'bound'")
        output = self.module(*args, **kwargs)
        entry, inputs, to_epilogue = computation_and_inputs(self.module, args, kwargs)
        values = (*args, *kwargs.values())
        self._keywords = tuple(kwargs)
        self._names = [f"argument {i}" for i in range(len(args))] + [f"keyword {k!r}" for k in kwargs]
        self._expected = [_TensorArgument(v.shape, v.dtype, v.device) if isinstance(v, torch.Tensor)
                          else _PlainArgument(v) for v in values]
        self._slots = _argument_slots(values, inputs)
        self._inputs = list(inputs)
        self._epilogue = functools.partial(entry.epilogue_fn, *to_epilogue)
        self.trace = entry.computation_traces[-1]
        if self.strategy == "bound":
            self._program = entry.computation_fn
            return output
        if self.strategy == "compiled":
            self._program = compiled_whole(self.trace)
        else:
            self._program = self._captured(entry)
        return _cloned(self._run()) if self.strategy == "graph" else self._run()

    def _captured(self, entry: Any) -> Callable[..., Any]:
        """Thunder's computation as CUDA graph(s), reading the arguments from buffers of its own."""
        if not all(isinstance(self._inputs[indices[0]], torch.Tensor) and self._inputs[indices[0]].is_cuda
                   for _, indices in self._slots):
            raise ValueError("thunder_tp.DecodeStep: strategy='graph' needs the arguments on a CUDA device")
        for _, indices in self._slots:
            buffer = self._inputs[indices[0]].clone()
            for i in indices:
                self._inputs[i] = buffer
        pool = torch.cuda.graph_pool_handle()
        if capturable(self.trace):
            return CapturedCall(entry.computation_fn, pool=pool)
        split = split_at_communication(self.trace, functools.partial(CapturedCall, pool=pool))
        return split.python_callable()


def _argument_slots(values: tuple, inputs: list) -> list[tuple[int, list[int]]]:
    """For each tensor argument, where the computation's inputs hold it; an error where the prologue passes a tensor
    made from it (a view or a copy), which a bound step would not make again."""
    slots = []
    for position, value in enumerate(values):
        if not isinstance(value, torch.Tensor):
            continue
        indices = [i for i, t in enumerate(inputs) if t is value]
        memory = value.untyped_storage().data_ptr()
        made = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t is not value and memory
                and t.untyped_storage().data_ptr() == memory]
        if made:
            raise ValueError(f"thunder_tp.DecodeStep: argument {position} reaches the computation as a tensor made "
                             "from it (a view or a copy), which a bound step cannot make again; call the module")
        if indices:
            slots.append((position, indices))
    return slots


def _cloned(output: Any) -> Any:
    """A graph's output, copied out of the memory the next replay overwrites."""
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, output)
