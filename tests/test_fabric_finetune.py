"""litgpt's finetune loops, unmodified, through ThunderTPStrategy: finetune.full and finetune.lora main on a JSON
instruction file the test writes, starting from a lit_model.pth the test writes; losses equal the same loops on one
device (float64)."""

from __future__ import annotations

import functools

import pytest
import torch

from tests import fabric_loops
from tests.dist import run_ranks
from tests.litgpt_models import lora_config

RTOL = 1e-6
TIMEOUT_S = 1200
LORA_CLI = ("--lora_r", "2", "--lora_alpha", "4", "--lora_query", "true", "--lora_key", "false", "--lora_value", "true",
            "--lora_projection", "true", "--lora_mlp", "true", "--lora_head", "true")


def _config(kind: str):
    return lora_config("qv") if kind == "lora" else fabric_loops.gqa_config()


@functools.cache
def _one_device(kind: str, root: str) -> tuple[float, ...]:
    directory = fabric_loops.write_checkpoint_dir(f"{root}/checkpoint", _config(kind), lora=kind == "lora")
    cli = LORA_CLI if kind == "lora" else ()
    return tuple(fabric_loops.finetune(kind, str(directory), f"{root}/one", None, _config(kind), cli=cli))


def _finetune_ranks(kind: str, root: str) -> list[float]:
    import torch.distributed as dist

    cli = LORA_CLI if kind == "lora" else ()
    return fabric_loops.finetune(kind, f"{root}/checkpoint", f"{root}/tp{dist.get_rank()}", {}, _config(kind), cli=cli)


@pytest.mark.slow  # reason: two litgpt finetuning runs on two ranks, each compiling a training and a validation program
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_finetune_tp2_equals_one_device(tmp_path, kind):
    expected = _one_device(kind, str(tmp_path))
    for losses in run_ranks(_finetune_ranks, 2, kind, str(tmp_path), timeout=TIMEOUT_S):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=RTOL, atol=0)
    if kind == "lora":  # litgpt merged the LoRA weights it saved (gathered from the ranks) into a full checkpoint
        assert (tmp_path / "tp0" / "final" / "lit_model.pth").is_file()
