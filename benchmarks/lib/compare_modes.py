"""The modes ``benchmark_litgpt --compare`` runs side by side: single device, thunder_tp, PyTorch DTensor TP (its plans
for the Llama) and HuggingFace's own TP, each a function that turns the model into the module to train."""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn

from benchmarks.lib.harness import EXECUTORS, Mode, seeded_model
from benchmarks.lib.llama import Llama, LlamaConfig, WithLoss, hf_config, litgpt_config, thunder_tp_plan


def dtensor_plan(kind: str, loss_parallel: bool = False) -> dict:
    """DTensor plan for ``Llama``: 'default' (per-linear), 'best' (shared inputs) or 'sp' (torchtitan's);
    loss_parallel leaves the logits a vocab-sharded DTensor (for
    ``torch.distributed.tensor.parallel.loss_parallel``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    sp = kind == "sp"
    act = Shard(1) if sp else Replicate()
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=act),
        "output": ColwiseParallel(input_layouts=act, output_layouts=Shard(-1), use_local_output=False)
        if loss_parallel else ColwiseParallel(input_layouts=act, output_layouts=Replicate()),
    }
    if sp:
        plan["norm"] = SequenceParallel()
    blk = "layers.*."
    for w in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
        plan[blk + w] = ColwiseParallel()
    plan[blk + "attention.wo"] = RowwiseParallel(output_layouts=act)
    plan[blk + "feed_forward.w2"] = RowwiseParallel(output_layouts=act)
    if kind != "default":
        # the module input becomes one Replicate DTensor shared by q/k/v (w1/w3): their Partial grads are summed
        # as DTensors and all-reduced once (the default plan all-reduces each linear's input grad separately)
        plan[blk + "attention"] = PrepareModuleInput(
            input_layouts=(act, None, None), desired_input_layouts=(Replicate(), None, None), use_local_output=False)
        plan[blk + "feed_forward"] = PrepareModuleInput(
            input_layouts=(act,), desired_input_layouts=(Replicate(),), use_local_output=False)
    if sp:
        plan[blk + "attention_norm"] = SequenceParallel()
        plan[blk + "ffn_norm"] = SequenceParallel()
    return plan


# --- modes (harness.Mode; model: "llama" or "litgpt") ----------------------------------------------------


def _thunder_single(executors_fn):
    def build(model):
        import thunder

        return thunder.jit(model, executors=executors_fn())

    return build


def _thunder_tp(plan_fn, executors_fn):
    def build(model):
        import thunder

        import thunder_tp

        return thunder.jit(model, transforms=[thunder_tp.TensorParallel(plan_fn(model))], executors=executors_fn())

    return build


def _auto_plan(model: nn.Module) -> dict:
    """plans.auto searched on meta tensors of a batch 4 x the model's sequence length (its RoPE tables' length)."""
    import thunder_tp

    batch = torch.zeros(4, model.model.cos.shape[0], dtype=torch.int64, device="meta")
    return thunder_tp.plans.auto(model, batch, batch, tp_size=dist.get_world_size())


def _dtensor(kind: str, compile: bool = False, loss_parallel: bool = False):
    def build(model):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_context
        from torch.distributed.tensor.parallel import parallelize_module

        device = "cuda" if torch.cuda.is_available() else "cpu"
        mesh = init_device_mesh(device, (dist.get_world_size(),))
        parallelize_module(model.model, mesh, dtensor_plan(kind, loss_parallel))
        if loss_parallel:
            from torch.distributed.tensor import DTensor, Replicate

            def replicated_targets(_module, args):
                idx, targets = args
                return idx, DTensor.from_local(targets, mesh, [Replicate()])

            model.register_forward_pre_hook(replicated_targets)
            model.step_context = loss_parallel_context  # forward and backward of the loss run inside it
        return torch.compile(model) if compile else model

    return build


def _hf_tp(model: nn.Module) -> nn.Module:
    """HF's own TP of the model (``from_pretrained(tp_plan="auto")``: its DTensor plan, eager), with the loss; each
    rank saves its (identical) copy first."""
    from transformers import AutoModelForCausalLM

    from thunder_tp.plans.hf import CausalLMLoss

    with tempfile.TemporaryDirectory(prefix="compare_hf_") as directory:
        model.model.save_pretrained(directory)
        return CausalLMLoss(AutoModelForCausalLM.from_pretrained(directory, tp_plan="auto", torch_dtype=torch.float32))


def _hf_plan(loss_parallel: bool):
    import thunder_tp

    return lambda model: thunder_tp.plans.hf(model, loss_parallel=loss_parallel)


def all_modes(executors: str = "thunder") -> list[Mode]:
    """Every mode; ``executors`` (a key of ``harness.EXECUTORS``) is what the thunder modes (but
    single_thunder_defaults) run with."""
    import thunder

    import thunder_tp

    chosen = EXECUTORS[executors]
    name = ("thunder_tp.executors()" if executors == "thunder"
            else "Thunder's default executors + thunder_tp's comm executor")

    def litgpt_plan(sp):
        return lambda model: thunder_tp.plans.litgpt(model, sequence_parallel=sp)

    def llama(name, ranks, runtime, build, description):
        return Mode(name, description, ranks, build, runtime=runtime, model="llama")

    def litgpt(name, ranks, build, description, model="litgpt"):
        return Mode(name, description, ranks, build, runtime="thunder", model=model)

    return [
        llama("single_eager", 1, "eager", lambda m: m, "1 rank, eager PyTorch"),
        llama("single_thunder", 1, "thunder", _thunder_single(chosen), f"1 rank, thunder.jit, executors={name}"),
        llama("single_thunder_defaults", 1, "thunder", _thunder_single(thunder.get_default_executors),
              "1 rank, thunder.jit, Thunder's default executors"),
        llama("single_thunder_inductor", 1, "thunder", _thunder_single(lambda: thunder_tp.executors("inductor")),
              "1 rank, thunder.jit, thunder_tp.executors('inductor') (on CUDA: Inductor's Triton kernels, not "
              "nvFuser)"),
        llama("thunder_tp_tp", 0, "thunder", _thunder_tp(lambda m: thunder_tp_plan(False), chosen), "thunder_tp TP"),
        llama("thunder_tp_sp", 0, "thunder", _thunder_tp(lambda m: thunder_tp_plan(True), chosen), "thunder_tp TP+SP"),
        llama("thunder_tp_auto", 0, "thunder", _thunder_tp(_auto_plan, chosen),
              "thunder_tp, the plan plans.auto searched (no hand plan)"),
        llama("thunder_tp_tp_lp", 0, "thunder", _thunder_tp(lambda m: thunder_tp_plan(False, True), chosen),
              "thunder_tp TP, loss parallel (logits stay vocab-sharded; compare with dtensor_tp_lp)"),
        llama("dtensor_tp_lp", 0, "eager", _dtensor("best", loss_parallel=True),
              "DTensor TP, best eager plan, loss parallel (torch's loss_parallel(); compare with thunder_tp_tp_lp)"),
        llama("dtensor_tp_default", 0, "eager", _dtensor("default"),
              "DTensor TP, default plan (Colwise/Rowwise per linear)"),
        llama("dtensor_tp", 0, "eager", _dtensor("best"),
              "DTensor TP, best eager plan (+PrepareModuleInput per attention/MLP)"),
        llama("dtensor_sp", 0, "eager", _dtensor("sp"), "DTensor TP+SP (torchtitan's plan)"),
        llama("dtensor_tp_compile", 0, "compile", _dtensor("best", compile=True),
              "DTensor TP, best plan, torch.compile"),
        litgpt("litgpt_single_thunder", 1, _thunder_single(chosen), f"litgpt GPT, 1 rank, thunder.jit, {name}"),
        litgpt("litgpt_thunder_tp_tp", 0, _thunder_tp(litgpt_plan(False), chosen),
               "litgpt GPT, thunder_tp TP (plans.litgpt)"),
        litgpt("litgpt_thunder_tp_sp", 0, _thunder_tp(litgpt_plan(True), chosen),
               "litgpt GPT, thunder_tp TP+SP (plans.litgpt)"),
        litgpt("hf_single_thunder", 1, _thunder_single(chosen), f"HF Llama, 1 rank, thunder.jit, {name}", "hf"),
        Mode("hf_tp", "HF Llama, HF's tp_plan='auto' (DTensor), eager", 0, _hf_tp, model="hf"),
        litgpt("hf_thunder_tp", 0, _thunder_tp(_hf_plan(False), chosen), "HF Llama, thunder_tp TP (plans.hf)", "hf"),
        litgpt("hf_thunder_tp_lp", 0, _thunder_tp(_hf_plan(True), chosen),
               "HF Llama, thunder_tp TP, loss parallel (plans.hf)", "hf"),
    ]


def select_modes(modes: list[Mode], wanted: str, skip: str) -> list[Mode]:
    """The modes named in ``wanted`` ('all' or comma-separated) but not in ``skip``; unknown names are an error."""
    names = {m.name for m in modes} if wanted == "all" else set(wanted.split(","))
    names -= set(skip.split(","))
    unknown = names - {m.name for m in modes}
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}; known: {[m.name for m in modes]}")
    return [m for m in modes if m.name in names]


def make_model(kind: str, cfg: LlamaConfig, seed: int) -> nn.Module:
    """The model a mode runs (its ``model``) with its loss: the Llama, or litgpt's or HF's Llama of the same dims."""
    if kind == "hf":
        from transformers import LlamaForCausalLM

        from thunder_tp.plans.hf import CausalLMLoss

        return seeded_model(lambda: CausalLMLoss(LlamaForCausalLM(hf_config(cfg))), seed)
    if kind == "litgpt":
        from thunder_tp.plans.litgpt import GPTWithLoss

        return seeded_model(lambda: GPTWithLoss(litgpt_config(cfg)), seed)
    return seeded_model(lambda: WithLoss(Llama(cfg)), seed)
