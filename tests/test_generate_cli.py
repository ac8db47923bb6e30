"""`python -m thunder_tp.generate` on a litgpt checkpoint directory the test makes (random weights, a tokenizer
trained on a few sentences): TP=2 under torchrun samples the single-device tokens (two samples of 32 tokens with
top-k, temperature and top-p, different from each other, alike on every rank), each decode step at Megatron's minimum
with the sampler's gather of each rank's candidates in place of the logits', with half the KV cache per rank, a
bounded number of compiles and timings taken after a warm-up; bad input gets a one-line error, no traceback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from litgpt import GPT, Config

from tests.dist import REPO_ROOT, free_port, launch_torchrun, run_ranks, start_forked
from thunder_tp.generate import cli, main
from thunder_tp.generate.generation import prefill_chunks
from thunder_tp.tools.debug import totals

SENTENCES = ["the llama eats grass and hay", "a tensor is split over the ranks", "every rank holds its heads",
             "the cache grows one token at a time", "what food do llamas eat"]
PROMPT = "what food do llamas eat"


def make_checkpoint_dir(directory) -> Config:
    """lit_model.pth of a random tiny llama, its model_config.yaml, a word-level tokenizer with an end token."""
    from litgpt.utils import save_config
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "tokenizer_class": "x"}))
    config = Config(name="tiny-llama", block_size=64, vocab_size=64, padded_vocab_size=64, n_layer=2, n_head=8,
                    n_query_groups=4, n_embd=64, head_size=8, intermediate_size=128, bias=False,
                    mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm", parallel_residual=False,
                    rotary_percentage=1.0)
    save_config(config, directory)
    torch.manual_seed(0)
    torch.save(GPT(config).double().state_dict(), directory / "lit_model.pth")
    return config


def _run(args: list[str]) -> subprocess.CompletedProcess:
    """The command line on two ranks under torchrun."""
    return launch_torchrun(["-m", "thunder_tp.generate", *args], timeout=600)


def test_cli_tp2_samples_the_single_device_tokens(tmp_path):
    """Seeded once per run: the two samples differ, and TP=2 draws the single-device ones (thunder_tp's sampler, on
    each rank's vocabulary shard inside the program, and on the whole logits on one device; float64 logits agree to
    ~1e-15); the CLI raises if any rank sampled otherwise. Thunder's executors (no Inductor compile; generation under
    thunder_tp's: tests/test_decode_step.py)."""
    config = make_checkpoint_dir(tmp_path)
    common = ["--checkpoint_dir", str(tmp_path), "--prompt", PROMPT, "--max_new_tokens", "32", "--temperature", "0.8",
              "--top_k", "5", "--top_p", "0.9", "--num_samples", "2", "--precision", "64-true"]
    single = main([*common, "--compile", "eager"])  # one device: in this process
    # decode steps bound: no Inductor compile here (the CPU default, compiled whole: the TP 3 test, test_decode_step)
    tp = _run([*common, "--compile", "thunder_default", "--decode_step", "bound",
               "--json_path", str(tmp_path / "tp.json")])
    assert tp.returncode == 0, tp.stderr[-3000:]
    tp_report = json.loads((tmp_path / "tp.json").read_text())
    samples = [s["generated_ids"] for s in tp_report["samples"]]
    assert samples == [s["generated_ids"] for s in single["samples"]], (samples, single["samples"])
    assert samples[0] != samples[1], samples
    assert tp_report["warm_up_s"] > 0 and single["warm_up_s"] is None  # compiled before timing; eager compiles nothing
    assert "Compiled in" in tp.stdout and "Time to first token" in tp.stdout, tp.stdout
    assert tp_report["kv_cache_bytes_per_rank"] * 2 == single["kv_cache_bytes_per_rank"]
    decode = totals(tp_report["decode_step_collectives"])
    assert {kind: t["count"] for kind, t in decode.items()} == {"all_reduce": 2 * config.n_layer + 1, "all_gather": 1}
    assert decode["all_gather"]["bytes"] == 5 * 2 * 8 * 2, decode  # 5 float64 (value, index) pairs a rank
    prompt_length = len(tp_report["samples"][0]["prompt_ids"])
    assert tp_report["compiles"] == len(set(prefill_chunks(prompt_length)) | {1}), tp_report["compiles"]


def test_prefill_chunks_are_powers_of_two():
    assert prefill_chunks(13) == [8, 4, 1] and prefill_chunks(16) == [16] and prefill_chunks(1) == [1]
    assert all(sum(prefill_chunks(n)) == n for n in range(1, 300))


@pytest.mark.parametrize("extra, message", [
    (["--max_new_tokens", "100"], "block_size is 64: shorten the prompt or lower --max_new_tokens"),
    (["--compile", "eager", "--tp_size", "2"], "--compile eager runs on one device only (--tp_size 1)"),
    (["--tp_size", "2"], "--tp_size 2 must equal the number of processes (1)"),
    (["--top_p", "1.5"], "top_p must be in [0, 1], got 1.5"),
])
def test_cli_bad_input(tmp_path, extra, message):
    make_checkpoint_dir(tmp_path)
    with pytest.raises(ValueError, match=re.escape(message)):
        main(["--checkpoint_dir", str(tmp_path), "--prompt", PROMPT, *extra])


def _cli_on_rank(argv: list[str], rank: int, port: int, world: int = 2) -> None:
    """``cli`` as torchrun starts it on rank `rank` of `world` (its environment variables)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.exit(cli(argv))


def test_cli_error_is_one_line_on_rank_0(tmp_path, capsys):
    """A refused request (prompt + new tokens past block_size): one line, no traceback, exit code 2 (the command
    line's ``cli``, in this process); on two ranks (torchrun's environment) printed once (rank 0) and every rank
    exits with code 2."""
    make_checkpoint_dir(tmp_path)
    args = ["--checkpoint_dir", str(tmp_path), "--prompt", PROMPT, "--max_new_tokens", "100"]
    message = ("thunder_tp.generate: error: a prompt of 5 tokens plus 100 new tokens needs 105 positions, but the "
               "model's block_size is 64: shorten the prompt or lower --max_new_tokens")
    assert cli(args) == 2
    plain = capsys.readouterr().err
    assert plain.splitlines() == [message], plain
    port, errors = free_port(), [tmp_path / f"rank{r}.err" for r in range(2)]
    ranks = [start_forked(_cli_on_rank, args, r, port, name=f"generate-rank{r}", stderr=str(errors[r]))
             for r in range(2)]
    for rank in ranks:
        rank.join(300)
        rank.kill()
    assert [rank.exitcode for rank in ranks] == [2, 2], [rank.exitcode for rank in ranks]
    assert [e.read_text().splitlines() for e in errors] == [[message], []], [e.read_text() for e in errors]


@pytest.mark.slow  # bf16 generation: test_bench_generate's test_batched_bf16; sampling: the TP=2 run above
def test_cli_tp2_bf16_with_sampling(tmp_path):
    """The meta-device model loaded from lit_model.pth in bf16, sampling with temperature, top-k and top-p: it runs,
    every rank picks the same tokens (the CLI checks), at the decode minimum with half the cache."""
    config = make_checkpoint_dir(tmp_path)
    args = ["--checkpoint_dir", str(tmp_path), "--prompt", PROMPT, "--max_new_tokens", "8", "--temperature", "0.9",
            "--top_k", "20", "--top_p", "0.95", "--num_samples", "2", "--precision", "bf16-true",
            "--compile", "thunder_default", "--json_path", str(tmp_path / "bf16.json")]
    proc = _run(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "bf16.json").read_text())
    assert len(report["samples"]) == 2 and all(s["generated_ids"] for s in report["samples"])
    context = len(report["samples"][0]["prompt_ids"]) + 8
    full_cache = 2 * config.n_layer * config.n_query_groups * context * config.head_size * 2  # k and v, 2-byte bf16
    assert report["kv_cache_bytes_per_rank"] * 2 == full_cache, report["kv_cache_bytes_per_rank"]
    counts = {kind: t["count"] for kind, t in totals(report["decode_step_collectives"]).items()}
    assert counts == {"all_reduce": 2 * config.n_layer + 1, "all_gather": 1}, counts


@pytest.mark.slow  # TP 3, more modes: litgpt's loops at TP 3 in test_sampling; the CLI's sampler at TP 2 above
def test_cli_tp3_samples_the_single_device_tokens(tmp_path):
    """At TP 3 (a vocabulary of 64: 22, 21 and 21 tokens a rank; 4 K/V heads: 2, 1, 1), ranks forked as torchrun
    starts them, decode steps as on the CPU by default (compiled whole): greedy, temperature alone, top-p alone, top-k
    with temperature and top-p, and litgpt's sampler on the gathered logits (--sampling gather), 32 tokens each, one
    device's tokens."""
    make_checkpoint_dir(tmp_path)
    common = ["--checkpoint_dir", str(tmp_path), "--prompt", PROMPT, "--max_new_tokens", "32", "--precision",
              "64-true", "--compile", "thunder_default"]
    for mode in (["--temperature", "0"], ["--top_k", "none"], ["--top_k", "none", "--top_p", "0.8"],
                 ["--top_k", "4", "--top_p", "0.9", "--temperature", "1.2"], ["--sampling", "gather"]):
        single = main([*common, *mode, "--compile", "eager"])
        path, port = tmp_path / "tp3.json", free_port()
        ranks = [start_forked(_cli_on_rank, [*common, *mode, "--json_path", str(path)], r, port, 3,
                              name=f"generate-rank{r}") for r in range(3)]
        for rank in ranks:
            rank.join(600)
            rank.kill()
        assert [rank.exitcode for rank in ranks] == [0, 0, 0], (mode, [rank.exitcode for rank in ranks])
        tp = json.loads(path.read_text())
        assert tp["samples"][0]["generated_ids"] == single["samples"][0]["generated_ids"], (mode, tp, single)


def _prompt_of_rank() -> str:
    import torch.distributed as dist

    from thunder_tp.generate.generation import GenerateError, check_same_prompt

    check_same_prompt(torch.tensor([5, 7, 9]))  # alike: nothing
    try:
        check_same_prompt(torch.tensor([5, 7, 9 + dist.get_rank()]))
    except GenerateError as e:
        return str(e)
    return "no error"


def test_different_prompts_raise_on_every_rank():
    for m in run_ranks(_prompt_of_rank, 2, timeout=120):
        assert "the prompt: 1 of 2 tensors differ across the ranks" in m and "token ids" in m, m
        assert "the same --prompt" in m, m


def test_help_shows_every_default_without_importing_torch():
    """--help is answered before anything heavy is imported (neither torch nor Thunder), with each default shown."""
    code = ("import sys, runpy; sys.argv = ['thunder_tp.generate', '--help']\n"
            "try:\n    runpy.run_module('thunder_tp.generate', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "print('torch imported' if 'torch' in sys.modules else 'torch not imported')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert out.stdout.rstrip().endswith("torch not imported"), out.stdout + out.stderr
    for shown in ("--temperature TEMPERATURE", "0 is greedy (default: 0.8)", "(default: bf16-true)",
                  "(default: auto)"):
        assert shown in " ".join(out.stdout.split()), out.stdout


def test_the_cli_lists_every_decode_step_strategy_and_sampler():
    from thunder_tp.generate import DECODE_STEPS, SAMPLERS
    from thunder_tp.models.litgpt_sampling import SAMPLERS as LOOP_SAMPLERS
    from thunder_tp.runtimes.decode_step import STRATEGIES

    assert tuple(DECODE_STEPS) == tuple(STRATEGIES) and SAMPLERS == LOOP_SAMPLERS
