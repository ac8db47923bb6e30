"""What ``python -m thunder_tp.generate`` runs (``thunder_tp.generate`` parses the command line): the model built on
the meta device, its KV cache made, jitted with TensorParallel and loaded slice by slice (or random weights); the
prompt prefilled in chunks of powers of two (at most log2(max_seq_length) + 1 compiled programs, the one-token chunk
being the decode program), a warm-up run compiling them before any timing; each sample's decode steps as a
``thunder_tp.DecodeStep`` (``Decoder``); each token sampled by ``TokenPicker`` (thunder_tp's sampler inside the jitted
program: no logits gathered; or litgpt's on the gathered logits); the sampler seeded once per run, alike on every
rank, and the ranks' tokens compared once per sequence."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import thunder
import torch
import torch.distributed as dist

import thunder_tp.checkpoint as ck
from thunder_tp import plans
from thunder_tp.collectives.run_mode import ranks_of
from thunder_tp.execution.executor import executors, thunder_default_executors
from thunder_tp.models.litgpt_sampling import next_tokens
from thunder_tp.ops.sampling import Sampling
from thunder_tp.runtimes.decode_step import DecodeStep, Strategy
from thunder_tp.runtimes.divergence import check_same_tensors, checksum
from thunder_tp.tools.debug import collectives_table
from thunder_tp.transform import TensorParallel


class GenerateError(ValueError):
    """A request the CLI refuses on purpose (printed as one line by ``thunder_tp.generate.cli``, no traceback)."""


_DTYPES = {"32-true": torch.float32, "bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}


def generate(args: argparse.Namespace) -> dict[str, Any]:
    """Generate and report; returns what ``--json_path`` gets."""
    tp_size = _init_distributed(args)
    sampling = _sampling(args)
    device = _device()
    config = _config(args)
    tokenizer = _tokenizer(args)
    prompt = _encode(args.prompt, tokenizer, config, device)
    check_same_prompt(prompt)
    max_seq_length = _check_lengths(config, prompt.numel(), args.max_new_tokens)
    model = _build(args, config, max_seq_length, device)
    jm = _jit(model, args.compile, tp_size)
    if args.checkpoint_dir is not None:
        ck.load(str(args.checkpoint_dir / "lit_model.pth"), jm)
    decoder = Decoder(jm, _strategy(args), max_seq_length)
    pick = TokenPicker(sampling, args.sampling, args.compile != "eager")
    positions = range(prompt.numel(), prompt.numel() + args.max_new_tokens - 1)
    warm_up_s = _warm_up(jm, decoder, prompt, positions, pick) if args.compile != "eager" else None
    torch.manual_seed(args.seed)  # once per run: each sample draws on from where the previous one stopped
    samples = [_sample_once(jm, decoder, model, prompt, args, tokenizer, pick) for _ in range(args.num_samples)]
    report = _report(jm, decoder, samples, tp_size, args, warm_up_s)
    if _rank() == 0:
        _print(report, tokenizer)
        if args.json_path is not None:
            args.json_path.write_text(json.dumps(report, indent=2))
    finish()
    return report


def finish() -> None:
    """Leave the process group (after a barrier), if one was joined."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _init_distributed(args: argparse.Namespace) -> int:
    """The TP size: the world size under torchrun (one TP group over all ranks), 1 in a plain process. The group
    is joined before the arguments are checked, so that every rank reaches ``cli``'s barrier."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    tp_size = args.tp_size or world
    if args.compile == "eager" and tp_size > 1:
        raise GenerateError("--compile eager runs on one device only (--tp_size 1): TP needs thunder or "
                            "thunder_default")
    if tp_size != world:
        raise GenerateError(f"--tp_size {tp_size} must equal the number of processes ({world}): launch with "
                            f"torchrun --nproc-per-node {tp_size}")
    if args.decode_step == "graph" and not torch.cuda.is_available():
        raise GenerateError("--decode_step graph replays CUDA graphs, but CUDA is not available: use bound or compiled")
    return tp_size


def _strategy(args: argparse.Namespace) -> Strategy | None:
    """The decode step's strategy (None: the model's own call each step, as with --compile eager); "auto": the
    fastest measured on the device (docs/results.md, "The decode step's host cost per layer")."""
    if args.decode_step == "off" or args.compile == "eager":
        return None
    if args.decode_step == "auto":
        return "graph" if torch.cuda.is_available() else "compiled"
    return args.decode_step


def _sampling(args: argparse.Namespace) -> Sampling:
    """--temperature, --top_k and --top_p, checked."""
    try:
        return Sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as error:
        raise GenerateError(str(error)) from None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _config(args: argparse.Namespace):
    from litgpt import Config

    if args.checkpoint_dir:
        config = Config.from_file(args.checkpoint_dir / "model_config.yaml")
    else:
        config = Config.from_name(args.model_name)
    if args.n_layers is not None:
        config.n_layer = args.n_layers
    return config


def _tokenizer(args: argparse.Namespace):
    from litgpt.tokenizer import Tokenizer

    return Tokenizer(args.checkpoint_dir) if args.checkpoint_dir is not None else None


def _encode(prompt: str, tokenizer, config, device: torch.device) -> torch.Tensor:
    """The prompt's token ids as int64, the dtype of sampled tokens, so prefill and decode share a program (without a
    tokenizer: its UTF-8 bytes, modulo the vocabulary)."""
    if tokenizer is not None:
        return tokenizer.encode(prompt, device=device).to(torch.int64)
    return torch.tensor([b % config.vocab_size for b in prompt.encode()], dtype=torch.int64, device=device)


def check_same_prompt(prompt: torch.Tensor) -> None:
    """Every rank must prefill the same prompt (one model computed over it): raise on every rank otherwise (one
    all_gather of its length and a checksum of its token ids)."""
    if not dist.is_initialized() or not ranks_of().has_peers:
        return
    try:
        check_same_tensors({"length": prompt.numel(), "token ids": checksum(prompt)}, dist.group.WORLD, "the prompt",
                           "Give every rank the same --prompt and tokenizer.")
    except RuntimeError as error:
        raise GenerateError(str(error)) from None


def _check_lengths(config, prompt_length: int, new_tokens: int) -> int:
    """The cache length the sequence needs; a clear error where the model cannot hold it."""
    needed = prompt_length + new_tokens
    if needed > config.block_size:
        raise GenerateError(f"a prompt of {prompt_length} tokens plus {new_tokens} new tokens needs {needed} "
                         f"positions, but the model's block_size is {config.block_size}: shorten the prompt or lower "
                         "--max_new_tokens")
    sliding = config.sliding_window_indices and any(config.sliding_window_indices)
    window = config.sliding_window_size if sliding else None
    if window is not None and prompt_length > window:
        raise GenerateError(f"a prompt of {prompt_length} tokens is longer than the model's sliding window ({window}): "
                         "litgpt's ring-buffer KV cache cannot prefill it; shorten the prompt")
    return needed


def _build(args: argparse.Namespace, config, max_seq_length: int, device: torch.device):
    """The GPT with its KV cache: on the meta device when a checkpoint fills it, else seeded random weights."""
    from litgpt import GPT
    from litgpt.model import build_mask_cache

    dtype = _DTYPES[args.precision]
    torch.manual_seed(args.seed)
    with torch.device("meta" if args.checkpoint_dir is not None else device):
        model = GPT(config).to(dtype)
        model.max_seq_length = max_seq_length
        model.set_kv_cache(batch_size=1, dtype=dtype)
    model.mask_cache = build_mask_cache(max_seq_length, device)
    return model.eval()


def _jit(model, compile: str, tp_size: int):
    if compile == "eager":
        return model
    transforms = [TensorParallel(plans.litgpt(model))] if tp_size > 1 else []
    chosen = executors() if compile == "thunder" else thunder_default_executors()
    return thunder.jit(model, transforms=transforms, executors=chosen)


def prefill_chunks(length: int) -> list[int]:
    """The prompt cut into chunks of powers of two, largest first: few distinct shapes, so few compiles."""
    return [1 << bit for bit in reversed(range(length.bit_length())) if length >> bit & 1]


@dataclass(frozen=True)
class TokenPicker:
    """How the CLI picks a token: with thunder_tp's sampler (``sampler`` "shards"), inside the program where
    ``in_program`` (a jitted model: under TP no logits are gathered) or on the logits; with litgpt's ``sample`` on the
    (gathered) logits ("gather")."""

    sampling: Sampling
    sampler: str
    in_program: bool

    def __call__(self, call: Callable[..., Any], tokens: torch.Tensor, *args: Any) -> torch.Tensor:
        """The (1, 1) int64 token after ``tokens`` (1, T): ``call(tokens, *args)`` is the model's call."""
        if self.sampler == "gather":
            from litgpt.generate.base import sample

            s = self.sampling
            return sample(call(tokens, *args), s.temperature, s.top_k, s.top_p).view(1, 1).to(torch.int64)
        return next_tokens(call, [self.sampling], self.in_program, tokens, *args)


@torch.inference_mode()
def prefill(jm, prompt: torch.Tensor, pick: TokenPicker) -> torch.Tensor:
    """Run the prompt (1-D token ids) through the model chunk by chunk, every chunk picking a token (one program
    per chunk length, the one-token chunk's that of a decode step); the last chunk's token."""
    start = 0
    for chunk in prefill_chunks(prompt.numel()):
        positions = torch.arange(start, start + chunk, device=prompt.device)
        token = pick(jm, prompt[None, start:start + chunk], positions)
        start += chunk
    return token


class Decoder:
    """The decode steps of a jitted litgpt GPT: ``decoder(tokens, position)`` gives the logits of ``tokens`` (B, 1)
    at ``position``. With a strategy, each batch size and bucket of positions has a ``DecodeStep`` (made on first use);
    under ``"graph"`` the attention reads the cache up to the bucket's end (litgpt's ``input_pos_maxp1``), buckets being
    powers of two from ``min_bucket`` up to the cache length, one graph each. Without a strategy, the model's call."""

    def __init__(self, jm, strategy: Strategy | None, max_seq_length: int, min_bucket: int = 256):
        self.jm, self.strategy, self.max_seq_length, self.min_bucket = jm, strategy, max_seq_length, min_bucket
        self.steps: dict[tuple[int, int], DecodeStep] = {}

    def bucket(self, position: int) -> int:
        """The cache length a step at ``position`` reads: the whole cache, or under ``"graph"`` the power of two
        (at least ``min_bucket``) past ``position``."""
        if self.strategy != "graph":
            return self.max_seq_length
        return min(self.max_seq_length, max(self.min_bucket, 1 << position.bit_length()))

    def __call__(self, tokens: torch.Tensor, position: int, **kwargs: Any) -> Any:
        """One decode step: the model's output (logits, or with a sampler's ``kwargs`` the tokens)."""
        where = torch.tensor([position], device=tokens.device)
        if self.strategy is None:
            return self.jm(tokens, where, **kwargs)
        bucket = self.bucket(position)
        key = (tokens.shape[0], bucket)
        if key not in self.steps:
            self.steps[key] = DecodeStep(self.jm, self.strategy)
        # the whole cache without the keyword: the program of a one-token prefill chunk
        if bucket < self.max_seq_length:
            kwargs["input_pos_maxp1"] = bucket
        return self.steps[key](tokens, where, **kwargs)


@torch.inference_mode()
def _warm_up(jm, decoder: Decoder, prompt: torch.Tensor, positions: range, pick: TokenPicker) -> float:
    """Compile the prefill programs and the decode programs by running them once, so that no timing includes a
    compilation or a capture (the cache they fill is reset before each sample); the seconds it took."""
    if _rank() == 0:
        print("Compiling the prefill and decode programs (minutes for a deep model on a CPU)...", flush=True)
    start = time.perf_counter()
    prefill(jm, prompt, pick)
    last = prompt.numel() - 1  # a decode step at the prompt's last position: in range whatever --max_new_tokens
    buckets = {decoder.bucket(p): p for p in reversed(positions)} or {decoder.bucket(last): last}
    token = prompt[last:].view(1, 1).clone()  # laid out as a sampled token: a compiled step guards on strides
    for position in buckets.values():  # each bucket's step, at the first position it serves
        _synchronize(pick(decoder, token, position))
    return time.perf_counter() - start


@torch.inference_mode()
def _sample_once(jm, decoder: Decoder, model, prompt: torch.Tensor, args: argparse.Namespace, tokenizer,
                 pick: TokenPicker) -> dict[str, Any]:
    """One sequence: prefill, then one token per step until --max_new_tokens or the end-of-sequence token."""
    for block in model.transformer.h:
        block.attn.kv_cache.reset_parameters()
    eos_id = tokenizer.eos_id if tokenizer is not None else None
    t0 = time.perf_counter()
    token = prefill(jm, prompt, pick)
    _synchronize(token)
    first = time.perf_counter()
    tokens = [token]
    for position in range(prompt.numel(), prompt.numel() + args.max_new_tokens - 1):
        if eos_id is not None and int(token) == eos_id:
            break
        token = pick(decoder, token, position)
        tokens.append(token)
    _synchronize(token)
    end = time.perf_counter()
    generated = torch.cat(tokens).view(-1).tolist()
    _check_ranks_agree(generated)
    decode_s = end - first
    return {"prompt_ids": prompt.tolist(), "generated_ids": generated, "time_to_first_token_s": first - t0,
            "decode_tokens_per_s": (len(generated) - 1) / decode_s if len(generated) > 1 else None}


def _synchronize(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def _check_ranks_agree(tokens: list[int]) -> None:
    """Every rank must have picked the same tokens (else their caches diverged): raise, never a silent mix. Under a
    fake group (``thunder_tp.one_rank``) nothing was exchanged and there is no other rank to compare with."""
    if not dist.is_initialized() or not ranks_of().has_peers:
        return
    everyone: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, tokens)
    if any(t != everyone[0] for t in everyone):
        raise RuntimeError(f"thunder_tp.generate: ranks generated different tokens {everyone}; every rank must sample "
                           "from the same logits with the same seed")


def _report(jm, decoder: Decoder, samples: list[dict[str, Any]], tp_size: int, args: argparse.Namespace,
            warm_up_s: float | None) -> dict[str, Any]:
    """Per-rank bytes, timings and (compiled modes) the collectives of one decode step and the compiles."""
    buffers = dict(jm.named_buffers())
    report = {
        "tp_size": tp_size,
        "sampling": args.sampling,
        "warm_up_s": warm_up_s,
        "samples": samples,
        "parameter_bytes_per_rank": sum(p.numel() * p.element_size() for p in jm.parameters()),
        "kv_cache_bytes_per_rank": sum(b.numel() * b.element_size() for n, b in buffers.items() if ".kv_cache." in n),
    }
    if args.compile != "eager":
        step = next(iter(decoder.steps.values()), None)
        report["decode_step"] = decoder.strategy or "off"
        report["decode_step_collectives"] = collectives_table(
            step.trace if step is not None else thunder.last_traces(jm)[-1])
        report["compiles"] = thunder.cache_misses(jm)
    return report


def _print(report: dict[str, Any], tokenizer) -> None:
    if report["warm_up_s"] is not None:
        print(f"Compiled in {report['warm_up_s']:.1f} s (a warm-up run; the times below exclude compilation)")
    for sample in report["samples"]:
        ids = sample["prompt_ids"] + sample["generated_ids"]
        print(tokenizer.decode(torch.tensor(ids)) if tokenizer is not None else f"token ids: {ids}")
        rate = sample["decode_tokens_per_s"]
        decode = f"{rate:.2f} tokens/s" if rate else "no tokens after the first"
        print(f"Time to first token: {sample['time_to_first_token_s']:.3f} s; decode: {decode}")
    print(f"Parameters per rank: {report['parameter_bytes_per_rank'] / 2**20:.2f} MiB; KV cache per rank: "
          f"{report['kv_cache_bytes_per_rank'] / 2**20:.2f} MiB (TP={report['tp_size']})")
    if "decode_step_collectives" in report:
        print(f"Collectives of one decode step:\n{report['decode_step_collectives']}")
    if "compiles" in report:
        print(f"Compiled programs: {report['compiles']}; decode steps: {report['decode_step']}")
