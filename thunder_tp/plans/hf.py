"""The TP plan for a HuggingFace transformers model, translated from the model's own `tp_plan`.

HF configs carry `base_model_tp_plan` (module-name globs -> "colwise", "rowwise", ...; relative to the base model)
and the CausalLM class adds `_tp_plan` (its head, "colwise_rep"). `hf` reads both and honours their intent at
Megatron's minimum of collectives, as `plans.litgpt` does for litgpt: attention projections split by whole heads
(K/V heads replicated where there are fewer of them than ranks), every down projection row-parallel, the embedding
and the head vocabulary-parallel (one vocab-sharded tensor when they are tied), OLMo-2's norms over all heads split
like the heads, MoE experts sharded like dense MLPs (or whole on their ranks: expert parallelism); optionally
sequence parallel and loss parallel.
"""

from __future__ import annotations

import fnmatch
import warnings

import torch
import torch.nn as nn

from thunder_tp.layouts import REPLICATE, Layout, Shard
from thunder_tp.models.hf import generation as hf_generation
from thunder_tp.models.hf import moe as hf_moe
from thunder_tp.models.hf import register_lookasides
from thunder_tp.models.hf.attention import head_dim, kv_heads
from thunder_tp.styles import (
    ColwiseParallel,
    FeatureShardedNorm,
    KVCacheParallel,
    RowwiseParallel,
    SequenceParallel,
    Style,
)
from thunder_tp.styles.expert import expert_parallel_plan
from thunder_tp.styles.matching import checked_plan
from thunder_tp.thunder_internals import versions

SEQUENCE_DIM = 1
#: the transformers versions whose models Thunder 0.2.6 traces (4.57 fails in Thunder's interpreter)
SUPPORTED_VERSIONS = versions.SUPPORTED["transformers"]
#: HF's style strings (transformers 4.52) -> what they mean for one projection: "col" split on the output
#: features, "row" on the input features, "replicate" not split, "sp" a norm on sequence shards. "_rep" / "local_"
#: variants differ from these only in where DTensor gathers or splits, which the layouts decide here.
_KINDS = {
    "colwise": "col", "colwise_rep": "col", "local_colwise": "col",
    "rowwise": "row", "rowwise_rep": "row", "local_rowwise": "row",
    "replicate": "replicate", "sequence_parallel": "sp",
}
#: attention projections split by whole heads: name -> whether its heads are K/V heads (replicable)
_HEAD_PROJECTIONS = {"q_proj": False, "k_proj": True, "v_proj": True, "query_key_value": False}
#: fused q|k|v projections in equal blocks (not interleaved per head): name -> the number of blocks
_FUSED_QKV_BLOCKS = {"c_attn": 3}
#: the plans of architectures whose config has none (transformers 4.52), keys relative to the base model, as HF's
_BUILT_IN_PLANS = {
    "gpt2": {"h.*.attn.c_attn": "colwise", "h.*.attn.c_proj": "rowwise", "h.*.mlp.c_fc": "colwise",
             "h.*.mlp.c_proj": "rowwise"},
}
#: where HF's plan is wrong: (model_type, module-name suffix) -> the kind it should have, and why
_FIXES = {("starcoder2", "mlp.c_proj"): "row"}  # Starcoder2 lists its down projection as "colwise"
#: norms over all heads of q (of k), which a head split shards (OLMo-2; per-head q/k norms need nothing)
_HEAD_NORMS = ("q_norm", "k_norm")


def hf(
    model: nn.Module, *, sequence_parallel: bool = False, loss_parallel: bool = False, expert_parallel: bool = False,
    tp_size: int | None = None,
) -> dict[str, Style]:
    """Plan for a HuggingFace transformers model (a CausalLM or a base model) from its own tp_plan.

    sequence_parallel: the norms and the residual stream sharded on the sequence dim. loss_parallel: the head's
    output stays vocab-sharded for the model's own loss (computed in forward when `labels` are passed); logits
    the model returns are still gathered, so jit a module that returns only the loss to skip that gather.
    expert_parallel: each rank holds num_experts / TP experts of every sparse MoE block whole, its tokens sent to
    them by all_to_all (router and shared expert replicated); otherwise every expert is split like a dense MLP.
    tp_size: the TP size the plan is for, checked now (an error naming the module and the sizes that work) rather
    than when TensorParallel applies it.
    A static KV cache (`thunder_tp.models.hf.set_kv_cache` called before the plan is made) is split like the K/V
    heads it caches, and lm_head's output stays vocab-sharded: `thunder_tp.models.hf.generate` samples on shards.
    """
    _check_version()
    register_lookasides(model)
    whole = model
    prefix, model = _hf_model(model)
    config = model.config
    reduced = Shard(SEQUENCE_DIM) if sequence_parallel else REPLICATE
    # under SP a Partial stream is reduce-scattered where a SequenceParallel norm reads it, which needs the norm's
    # weight consumed as it is; Cohere's LayerNorm casts it first, so its block outputs are reduce-scattered apart
    parallel = _parallel_residual(config) and not sequence_parallel
    block_output = None if parallel else reduced  # a parallel-residual block's two outputs are reduced together
    plan: dict[str, Style] = {}
    for name, kind in _module_kinds(model).items():
        style = _style(model, name, kind, block_output)
        if style is not None:
            plan[name] = style
    plan |= _moe_plan(model, reduced) if expert_parallel else _moe_plan(model)
    plan[_name_of(model, model.get_input_embeddings())] = RowwiseParallel(output_layout=reduced)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    caches = hf_generation.cache_names(model)  # decoding: the head's output sampled on vocabulary shards
    if head is not None:
        plan[_name_of(model, head)] = ColwiseParallel(output_layout=None if loss_parallel or caches else REPLICATE)
    plan |= {name: KVCacheParallel() for name in caches}
    heads = FeatureShardedNorm(unit=head_dim(config), groups=kv_heads(config))  # split like the heads they norm
    plan |= {name: heads for name in _all_head_norms(model)}
    if sequence_parallel:
        plan |= {name: SequenceParallel(SEQUENCE_DIM) for name in _residual_norms(model)}
    return checked_plan(whole, {prefix + name: style for name, style in plan.items()}, tp_size)


class CausalLMLoss(nn.Module):
    """An HF CausalLM that returns only its loss: the logits, which the model would return whole, are then never
    gathered (with loss_parallel, never whole anywhere). Plan it with `hf(CausalLMLoss(model), ...)`."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


def _hf_model(model: nn.Module) -> tuple[str, nn.Module]:
    """The HF model in `model` (itself, or a submodule of a wrapper such as CausalLMLoss) and its name prefix."""
    from transformers import PreTrainedModel

    for name, module in model.named_modules():
        if isinstance(module, PreTrainedModel):
            return (f"{name}." if name else ""), module
    raise TypeError(
        f"thunder_tp.plans.hf needs a HuggingFace transformers PreTrainedModel (or a module containing one), got "
        f"{type(model).__name__}; for a litgpt GPT use thunder_tp.plans.litgpt"
    )


def _check_version() -> None:
    """A warning naming the supported range when transformers is another version (thunder_internals.versions)."""
    import transformers

    if not versions.supports("transformers", transformers.__version__):
        warnings.warn(
            f"thunder_tp.plans.hf is tested with transformers{SUPPORTED_VERSIONS} (4.52.4, the version Thunder "
            f"{versions.SUPPORTED['lightning-thunder'].lstrip('=')} tests against); {transformers.__version__} is "
            "installed, whose models Thunder may not trace (4.57 fails in Thunder's interpreter): "
            "pip install transformers==4.52.4",
            stacklevel=3,
        )


def _base_prefix(model: nn.Module) -> str:
    """Where the base model sits ("model." in a LlamaForCausalLM; "" for a base model itself): the first
    submodule that is a PreTrainedModel (`base_model_prefix` is not always its name, e.g. Gemma3ForCausalLM)."""
    from transformers import PreTrainedModel

    for name, module in model.named_modules():
        if name and isinstance(module, PreTrainedModel):
            return f"{name}."
    return ""


def hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's own plan, keys relative to `model`: config.base_model_tp_plan at the base model, plus the
    CausalLM class's `_tp_plan` (its head). A clear error for a model without one."""
    base = getattr(model.config, "base_model_tp_plan", None) or _BUILT_IN_PLANS.get(model.config.model_type, {})
    prefix = _base_prefix(model)
    plan = {prefix + key: string for key, string in base.items()}
    if prefix:
        plan |= type(model)._tp_plan or {}
    if not base:
        raise ValueError(
            f"thunder_tp.plans.hf: {type(model).__name__} has no tp_plan (its config's base_model_tp_plan is "
            f"{base!r}); pass a hand plan instead: TensorParallel({{'model.layers.*.self_attn.q_proj': "
            "ColwiseParallel(), ...}})"
        )
    return plan


def _module_kinds(model: nn.Module) -> dict[str, str]:
    """Every module HF's plan names (keys matching no module, e.g. dense-MLP keys in MoE layers, are skipped) ->
    the kind of split it gets, HF's mistakes fixed; the head and the embedding are planned separately."""
    names = [name for name, _ in model.named_modules() if name]
    special = {_name_of(model, model.get_input_embeddings())}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        special.add(_name_of(model, head))
    kinds: dict[str, str] = {}
    for key, string in hf_tp_plan(model).items():
        pattern = key.removesuffix(".weight").removesuffix(".bias")  # some plans name a parameter
        for name in fnmatch.filter(names, pattern):
            if name in special or _in_moe_block(model, name):
                continue
            kinds[name] = _fixed(model.config, name, _kind(string, name))
    return kinds


def _kind(string: str, name: str) -> str:
    """The kind of an HF style string, or a clear error for one this translation does not implement."""
    if string not in _KINDS:
        raise NotImplementedError(
            f"thunder_tp.plans.hf: {name!r} has the tp_plan style {string!r}, which thunder_tp does not translate "
            f"(it translates {', '.join(sorted(_KINDS))}); pass a hand plan for this model instead, e.g. "
            f"TensorParallel({{{name!r}: ColwiseParallel(), ...}})"
        )
    return _KINDS[string]


def _fixed(config, name: str, kind: str) -> str:
    """The kind, corrected where HF's plan for this model type is wrong."""
    for (model_type, suffix), fixed in _FIXES.items():
        if config.model_type == model_type and name.endswith(suffix):
            return fixed
    return kind


def _style(model: nn.Module, name: str, kind: str, block_output: Layout | None) -> Style | None:
    """The thunder_tp style of one module of HF's plan."""
    if kind == "row":
        if not _reads_heads(model, name):
            return RowwiseParallel(output_layout=block_output)
        config = model.config
        return RowwiseParallel(output_layout=block_output, unit=head_dim(config), groups=kv_heads(config))
    if kind == "sp":
        return SequenceParallel(SEQUENCE_DIM)
    if kind == "replicate":
        return None
    return _head_style(model, name) or ColwiseParallel()


def _head_style(model: nn.Module, name: str) -> ColwiseParallel | None:
    """An attention projection split by whole heads (K/V heads replicable), or None for another module."""
    last = name.rpartition(".")[2]
    config = model.config
    features = _out_features(model.get_submodule(name))
    if last in _FUSED_QKV_BLOCKS:
        blocks = _FUSED_QKV_BLOCKS[last]
        return ColwiseParallel(blocks=(features // blocks,) * blocks, unit=head_dim(config), groups=kv_heads(config))
    if last not in _HEAD_PROJECTIONS:
        return None
    kv = _HEAD_PROJECTIONS[last]
    heads = kv_heads(config) if kv else config.num_attention_heads
    return ColwiseParallel(blocks=(features,), unit=features // heads, replicable=(kv,), groups=kv_heads(config))


def _out_features(module: nn.Module) -> int:
    """A linear layer's output features (nn.Linear's out_features, HF Conv1D's nf)."""
    return module.out_features if hasattr(module, "out_features") else module.nf


def _reads_heads(model: nn.Module, name: str) -> bool:
    """Whether a row-parallel projection reads the attention heads (a sibling of the q / fused qkv projection)."""
    parent = model.get_submodule(name.rpartition(".")[0])
    return any(hasattr(parent, projection) for projection in (*_HEAD_PROJECTIONS, *_FUSED_QKV_BLOCKS))


def _parallel_residual(config) -> bool:
    """Attention and MLP of a block read the same input and their outputs go straight into one sum (Cohere), so
    they are reduced together; GPT-NeoX's parallel residual applies dropout to each first, so each is reduced."""
    return config.model_type == "cohere"


def _name_of(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def _all_head_norms(model: nn.Module) -> list[str]:
    """q/k norms over all heads (a weight as wide as the projection's output, as OLMo-2's)."""
    found = []
    for name, module in model.named_modules():
        attention, _, last = name.rpartition(".")
        if last in _HEAD_NORMS and getattr(module, "weight", None) is not None and module.weight.ndim == 1:
            projection = model.get_submodule(f"{attention}.{last[0]}_proj")
            if module.weight.shape[0] == projection.out_features:
                found.append(name)
    return found


def _residual_norms(model: nn.Module) -> list[str]:
    """The norms applied to the residual stream (each block's and the final one): those whose weight spans the
    hidden size, outside attention."""
    hidden = model.config.hidden_size
    return [
        name
        for name, module in model.named_modules()
        if "norm" in type(module).__name__.lower()
        and name.rpartition(".")[2] not in _HEAD_NORMS
        and getattr(module, "weight", None) is not None
        and tuple(module.weight.shape) == (hidden,)
    ]


# --- mixture of experts ---------------------------------------------------------------------------------------


def _in_moe_block(model: nn.Module, name: str) -> bool:
    """Whether `name` lies inside a sparse MoE block (planned by `_moe_plan`, whatever HF's plan says)."""
    return any(name.startswith(f"{block}.") for block in _moe_blocks(model))


def _moe_blocks(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if hf_moe.is_moe_block(module)]


def _moe_plan(model: nn.Module, expert_parallel_output: Layout | None = None) -> dict[str, Style]:
    """Sparse MoE blocks, traced as one `moe_layer` op: every expert (and the shared expert) sharded like a dense
    MLP, router (and shared-expert gate) replicated; the op's rule reduces the block's output once. With
    `expert_parallel_output` (the layout of the block's output): experts whole on their ranks instead, router and
    shared expert replicated."""
    plan: dict[str, Style] = {}
    for block in _moe_blocks(model):
        module = model.get_submodule(block)
        hf_moe.check_supported(module, block)
        if expert_parallel_output is not None:
            experts = expert_parallel_plan(len(module.experts), hf_moe.expert_layers(module), expert_parallel_output)
            plan |= {f"{block}.{name}": style for name, style in experts.items()}
            continue
        gate, up, down = hf_moe.expert_layers(module)
        experts = [f"{block}.experts.*"] + ([f"{block}.shared_expert"] if hasattr(module, "shared_expert") else [])
        for expert in experts:
            plan |= {f"{expert}.{gate}": ColwiseParallel(), f"{expert}.{up}": ColwiseParallel(),
                     f"{expert}.{down}": RowwiseParallel()}
    return plan
