"""The litgpt benchmark's float8 training (Thunder benchmark_litgpt's ``--use_torchao_fp8_linear`` and
``--use_torchao_fp8_allgather``): the model converted by torchao's ``convert_to_float8_training``, which thunder_tp
traces (``thunder_tp.models.torchao``); the flags' bad combinations named with their fix."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util

import torch
import torch.nn as nn

#: the recipe whose input scaling torchao's Float8ColwiseParallel gathers in float8 (its only one)
GATHERED_RECIPE = "tensorwise"
#: what a float8 gemm (torch._scaled_mm) needs of a CUDA device: Ada or Hopper on
FLOAT8_CAPABILITY = (8, 9)


def torchao_installed() -> bool:
    """Whether torchao (the optional extra thunder_tp[float8]) can be imported."""
    return importlib.util.find_spec("torchao") is not None


def option_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the float8 flags together, naming the fix; None where nothing is."""
    if not (args.use_torchao_fp8_linear or args.use_torchao_fp8_allgather):
        return None
    if not torchao_installed():
        return "the float8 flags convert the model with torchao, which is not installed: pip install thunder_tp[float8]"
    if not args.use_torchao_fp8_linear:
        return ("--use_torchao_fp8_allgather gathers the input of float8 linears in float8: add "
                "--use_torchao_fp8_linear true")
    from torchao.float8.config import Float8LinearRecipeName

    recipes = [r.value for r in Float8LinearRecipeName]
    if args.torchao_fp8_recipe not in recipes:
        return f"--torchao_fp8_recipe {args.torchao_fp8_recipe!r} is not one of torchao's recipes: {recipes}"
    if args.use_torchao_fp8_allgather and args.torchao_fp8_recipe != GATHERED_RECIPE:
        return (f"--use_torchao_fp8_allgather with --torchao_fp8_recipe {args.torchao_fp8_recipe}: torchao's "
                f"Float8ColwiseParallel gathers in float8 only with {GATHERED_RECIPE} scaling (one scale for the "
                f"whole input); use --torchao_fp8_recipe {GATHERED_RECIPE}, or drop --use_torchao_fp8_allgather "
                "(the input is then gathered in high precision)")
    if args.use_torchao_fp8_allgather and args.distributed_mode != "tp_sp":
        return (f"--use_torchao_fp8_allgather casts the input of sequence parallelism's all_gather to float8; "
                f"--distributed_mode {args.distributed_mode} gathers no activation: use --distributed_mode tp_sp, "
                "or drop the flag")
    return None


def keeps_in_high_precision(module: nn.Module, name: str) -> bool:
    """The linears left unconverted, as torchtitan leaves them: the head, and those whose dims are not multiples of
    16 (what torch._scaled_mm takes)."""
    return name.rsplit(".", 1)[-1] == "lm_head" or module.in_features % 16 != 0 or module.out_features % 16 != 0


def convert_to_float8(model: nn.Module, recipe: str, device: torch.device) -> nn.Module:
    """``model`` with its linears (but those ``keeps_in_high_precision`` names) torchao's Float8Linear of ``recipe``:
    torch._scaled_mm on a CUDA device that has it, emulated in high precision on the CPU."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if capability is not None and capability < FLOAT8_CAPABILITY:
        raise SystemExit(f"--use_torchao_fp8_linear on CUDA needs compute capability {FLOAT8_CAPABILITY} or higher "
                         f"for float8 gemms (torch._scaled_mm); this GPU has {capability}")
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=capability is None)
    return convert_to_float8_training(model, config=config,
                                      module_filter_fn=lambda m, name: not keeps_in_high_precision(m, name))


def count_float8_linears(model: nn.Module) -> int:
    """How many of the model's linears are torchao's Float8Linear."""
    from torchao.float8.float8_linear import Float8Linear

    return sum(isinstance(m, Float8Linear) for m in model.modules())
