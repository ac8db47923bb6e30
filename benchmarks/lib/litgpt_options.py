"""benchmark_litgpt's command line: Thunder benchmark_litgpt's flags (names and semantics), thunder_tp's own, and
the combinations refused with their fix (``parse_args``)."""

from __future__ import annotations

import argparse
import importlib.util

from benchmarks.lib.harness import EXECUTORS, options
from benchmarks.lib.litgpt_setup import FP8_MODES, TRAINER_MODES


def str2bool(value: str | bool) -> bool:
    """"true"/"false" (and yes/no, 1/0) as jsonargparse reads them in Thunder's benchmark_litgpt."""
    v = str(value).strip().lower()  # a bool default too
    if v in ("true", "t", "yes", "y", "1", "on"):
        return True
    if v in ("false", "f", "no", "n", "0", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {value!r}")


B = str2bool  # the table's boolean type
#: benchmark_litgpt's flags: (name, type, default, help[, other add_argument keywords])
FLAGS = [
    ("model_name", str, "pythia-14m", "litgpt Config.from_name (random weights)"),
    ("litgpt_config", str, "", "JSON of litgpt Config fields over --model_name's, e.g. '{\"n_embd\": 64, \"n_head\": "
     "4, \"head_size\": 16}'"),
    ("n_layers", int, None, "override the config's n_layer"),
    ("block_size", int, 128, "sequence length (overrides the config's block_size)"),
    ("micro_batch_size", int, 2, None),
    ("global_batch_size", int, None, "sequences per optimizer step over all data-parallel ranks; a multiple of "
     "micro_batch_size * dp size: gradients accumulate over the micro-batches (default: micro_batch_size * dp size)"),
    ("checkpoint_activations", B, False, "activation checkpointing of every transformer block "
     "(torch.utils.checkpoint, which Thunder turns into recomputation in the backward, collectives included)"),
    ("low_precision_mode", str, "none", "Thunder's fp8 modes need TransformerEngine on CUDA, which thunder_tp does "
     "not support: none only", {"choices": ["none", *FP8_MODES]}),
    ("use_torchao_fp8_linear", B, False, "torchao's float8 training of the linears but the head and those with dims "
     "not multiples of 16 (sm89+ on CUDA, emulated on the CPU); needs pip install thunder_tp[float8]"),
    ("use_torchao_fp8_allgather", B, False, "tp_sp: a float8 column-parallel linear's input gathered in float8 "
     "(TensorParallel(float8_all_gather=True), as torchao's Float8ColwiseParallel)"),
    ("torchao_fp8_recipe", str, "tensorwise",
     "torchao's recipe (tensorwise, rowwise, rowwise_with_gw_hp) of --use_torchao_fp8_linear"),
    ("tp_overlap", str, "auto", "TensorParallel(overlap=...): collectives decomposed to overlap their matmuls where "
     "the cost model says it pays (auto), wherever the shapes allow (always), or nowhere (never)",
     {"choices": ["auto", "always", "never"]}),
    ("max_iters", int, 10, "iterations in all, warm-up included"),
    ("warmup_iters", int, 2, "first iterations left out of the averages"),
    ("measure_step_memory", B, False, "measure the last iteration's peak memory above what is live before it, on "
     "every rank (CPU: the rise of the resident set's peak, VmHWM reset first; CUDA: max_memory_allocated)"),
    ("compile", str, "thunder", "thunder: thunder_tp.executors() (fusion executor); thunder_default: Thunder's "
     "default executors + thunder_tp's comm executor; eager: plain PyTorch (distributed_mode none only)",
     {"choices": sorted(EXECUTORS) + ["eager"]}),
    ("distributed_mode", str, "none", None, {"choices": TRAINER_MODES}),
    ("tp_size", int, None, "TP group size (default: the world size)"),
    ("context_parallel_size", int, 1, "CP group size: the sequence split over it (thunder_tp.ContextParallel, before "
     "the mode's TP); world = dp * cp * tp, TP fastest"),
    ("cp_rotate", str, "allgather", "ContextParallel(rotate=...): keys and values all-gathered, or passed around the "
     "CP ring", {"choices": ["allgather", "ring"]}),
    ("cp_load_balance", B, True, "ContextParallel(load_balance=...): head-tail order of the sequence chunks for "
     "causal attention (block_size a multiple of 2 * cp; without it, of cp)"),
    ("dp_size", int, None, "data-parallel size of the 2-D modes (tp_ddp, tp_fsdp); dp * tp = world (default: world "
     "// tp)"),
    ("plan", str, "hand", "hand: plans.litgpt; auto: plans.auto searches the plan (printed by rank 0)",
     {"choices": ["hand", "auto"]}),
    ("loss_parallel", B, False, "cross-entropy over vocab-sharded logits"),
    ("dump_thunder_traces", B, False, "every rank writes its final traces to --trace_dir (one line says where)"),
    ("trace_dir", str, "traces", "where --dump_thunder_traces writes rank{r}_* files"),
    ("learning_rate", float, 0.5, "SGD learning rate"),
    ("seed", int, 1337, None),
    ("timeout", float, None, "process-group timeout in seconds (a hung peer's collective fails after it; default "
     "torch's)"),
    ("save_checkpoint", str, "", "at the end, ck.save the model and optimizer to this DCP dir"),
    ("resume", str, "", "ck.load model and optimizer from a DCP dir (saved at any TP size)"),
    ("checkpoint", str, "", "start from a full state-dict file such as litgpt's lit_model.pth"),
    ("simulate", int, 0, "dry run in one plain process: N simulated ranks (thunder_tp.simulate), one forward + "
     "backward; prints each rank's parameter bytes and collectives (no torchrun)", {"metavar": "N"}),
]
#: the side-by-side run's own flags (``lib/side_by_side.py``), in the same form
COMPARE_FLAGS = [
    ("compare", str, "", "comma-separated modes (or 'all') trained side by side, each gated against one device, "
     "timed in alternating rounds"),
    ("skip", str, "", "comma-separated modes to leave out of --compare"),
    ("llama_config", str, "", "JSON of LlamaConfig fields over lib/llama.py's (dim 512, 4 layers, 8 / 4 heads, FFN "
     "1536, vocab 8192), e.g. '{\"dim\": 64}'"),
    ("rounds", int, 5, "alternating rounds the timed steps are spread over"),
    ("grad_rtol", float, 1e-4, "first-step gradient tolerance, relative to each gradient's largest entry"),
    ("fresh_inductor_cache", B, True, "compile into an empty Inductor cache (honest first-iteration times)"),
    ("pin_cores", B, True, "CPU runs: pin local rank r to core r"),
]


def add_flags(p, flags: list[tuple]) -> None:
    """Declares ``flags`` (rows of FLAGS' form) on the parser or group ``p``."""
    for name, kind, default, help_, *more in flags:
        p.add_argument(f"--{name}", type=kind, default=default, help=help_, **dict(*more))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = options("Training benchmark of a litgpt GPT under thunder_tp tensor parallelism.", dtype="float32")
    add_flags(p, FLAGS)
    add_flags(p.add_argument_group("side by side (--compare): modes of lib/modes.py"), COMPARE_FLAGS)
    args = p.parse_args(argv)
    if args.compare and args.compile == "eager":
        p.error("--compare runs every mode it names (eager is the eager one): use --compile thunder or "
                "thunder_default")
    if args.simulate and args.distributed_mode not in ("tp", "tp_sp"):
        p.error(f"--simulate simulates a TP plan: use --distributed_mode tp or tp_sp, not {args.distributed_mode!r}")
    if args.max_iters <= args.warmup_iters:
        p.error(f"--max_iters ({args.max_iters}) must be larger than --warmup_iters ({args.warmup_iters})")
    if args.low_precision_mode != "none":
        p.error(f"--low_precision_mode {args.low_precision_mode}: fp8 through TransformerEngine is not supported by "
                "thunder_tp; use --low_precision_mode none with --dtype bfloat16 for a bf16 model")
    if error := option_error(args) or context_parallel_error(args):
        p.error(error)
    if args.compile == "eager" and args.distributed_mode != "none":
        p.error("--compile eager runs plain PyTorch, which has no tensor parallelism: use --distributed_mode none, "
                "or --compile thunder / thunder_default")
    return args


def context_parallel_error(args: argparse.Namespace) -> str | None:
    """Why the context-parallel flags cannot run as given, with the fix; None if they can."""
    cp_size = args.context_parallel_size
    if cp_size < 1:
        return f"--context_parallel_size must be at least 1, got {cp_size}"
    if cp_size == 1:
        return None
    if args.simulate:
        return "--simulate simulates a TP plan: leave out --context_parallel_size"
    if args.compile == "eager":
        return "--compile eager runs plain PyTorch, which has no context parallelism: use --compile thunder"
    from thunder_tp.context_parallel import sequence_layout
    try:
        sequence_layout(args.block_size, 1, cp_size, args.cp_load_balance)
    except ValueError as error:
        return (f"--block_size {args.block_size} with --context_parallel_size {cp_size}: {error} (here: "
                f"--block_size{', or --cp_load_balance false' if args.cp_load_balance else ''})")
    return None


#: the recipe whose input scaling torchao's Float8ColwiseParallel gathers in float8 (its only one)
GATHERED_RECIPE = "tensorwise"


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
