"""litgpt's own training loops driven through Lightning Fabric, for tests/test_fabric*.py: a Fabric on one device or
on the ranks of a test pool with ThunderTPStrategy, a text data module and a loss-collecting logger."""

from __future__ import annotations

import contextlib
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

SEQ = 16
TEXT = (
    "Tensor parallelism splits each weight matrix of a model over the ranks of a group, so that every rank computes "
    "its share of every layer on the same batch. The ranks then exchange partial sums at the end of each block. "
) * 6


def neox_config(**overrides):
    """A tiny GPT-NeoX-like litgpt config (LayerNorm: float64 throughout, for exact comparisons)."""
    from litgpt import Config

    kw = dict(name="tiny-neox", block_size=SEQ, vocab_size=256, padded_vocab_size=256, n_layer=2, n_head=4,
              n_query_groups=4, n_embd=32, head_size=8, intermediate_size=64, bias=True, mlp_class_name="GptNeoxMLP",
              norm_class_name="LayerNorm", parallel_residual=True, rotary_percentage=0.25)
    return Config(**(kw | overrides))


def gqa_config(**overrides):
    """The same with 2 K/V groups for 4 query heads: at TP 4 each K/V head is replicated on 2 ranks."""
    return neox_config(**dict(name="tiny-gqa", n_query_groups=2) | overrides)


class Losses:
    """A Fabric logger that keeps every logged metric (on every rank)."""

    name, version, root_dir, log_dir, group_separator = "losses", 0, None, None, "/"

    def __init__(self):
        self.metrics: list[dict] = []

    def log_metrics(self, metrics: dict, step=None) -> None:
        self.metrics.append({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float, torch.Tensor))})

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def save(self) -> None:
        pass

    def finalize(self, status: str) -> None:
        pass

    def values(self, key: str = "loss") -> list[float]:
        return [m[key] for m in self.metrics if key in m]


class _Samples(Dataset):
    def __init__(self, tokens: torch.Tensor, length: int):
        self.tokens, self.length = tokens, length

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i * self.length : i * self.length + self.length + 1]


class ResumableLoader(DataLoader):
    """A DataLoader that Fabric saves and restores (state_dict: the batches yielded; after load_state_dict the next
    iteration skips them), as litdata's StreamingDataLoader is for litgpt's pretraining data."""

    def __iter__(self):
        skip, self._skip = getattr(self, "_skip", 0), 0
        self._yielded = skip
        for i, batch in enumerate(super().__iter__()):
            if i < skip:
                continue
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict:
        return {"yielded": getattr(self, "_yielded", 0)}

    def load_state_dict(self, state: dict) -> None:
        self._skip = state["yielded"]


@dataclass
class TextBytes:
    """A litgpt DataModule over a text file the test writes, one token per byte (no tokenizer, no download)."""

    path: Path
    batch_size: int = 1
    seq: int = SEQ

    def connect(self, tokenizer=None, batch_size: int = 1, max_seq_length: int | None = None, **kwargs) -> None:
        self.batch_size = batch_size
        self.seq = max_seq_length or self.seq

    def prepare_data(self) -> None:
        pass

    def setup(self, stage: str = "") -> None:
        self.tokens = torch.tensor(list(Path(self.path).read_bytes()), dtype=torch.long)

    def train_dataloader(self) -> DataLoader:
        return ResumableLoader(_Samples(self.tokens, self.seq), batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_Samples(self.tokens[: 4 * self.seq + 1], self.seq), batch_size=self.batch_size)


def write_text(directory: Path) -> Path:
    path = Path(directory) / "text.txt"
    path.write_text(TEXT)
    return path


def fabric(strategy_kwargs: dict | None, logger: Losses, precision: str = "64-true"):
    """A launched Fabric: one device (strategy_kwargs None), or ThunderTPStrategy on this pool's ranks."""
    import lightning as L
    import torch.distributed as dist

    if strategy_kwargs is None:
        return L.Fabric(accelerator="cpu", devices=1, precision=precision, loggers=[logger])
    from thunder_tp.fabric import ThunderTPStrategy

    os.environ["LOCAL_RANK"] = str(dist.get_rank())  # the pool's processes are launched outside Fabric, as by torchrun
    if strategy_kwargs.get("executors") == "fast":  # no Inductor compile: tests/tp_checks.FAST_EXECUTORS
        from tests.tp_checks import FAST_EXECUTORS

        strategy_kwargs = strategy_kwargs | {"executors": FAST_EXECUTORS}
    f = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=ThunderTPStrategy(**strategy_kwargs),
                 precision=precision, loggers=[logger])
    f.launch()
    return f


@contextmanager
def cli_args(*args: str):
    """sys.argv as the script's CLI would have it (litgpt saves its hyperparameters from the command line)."""
    saved = sys.argv
    sys.argv = ["litgpt", *args]
    try:
        yield
    finally:
        sys.argv = saved


def pretrain(directory: str, strategy_kwargs: dict | None, *, iters: int, config=None, accumulate: int = 1,
             data_parallel: int = 1, resume: bool | Path = False, save_interval: int | None = None,
             micro_batch_size: int = 2, fabrics: list | None = None) -> list[float]:
    """litgpt.pretrain.main for `iters` iterations (micro-batches); the losses it logged (the Fabric appended to
    `fabrics`)."""
    from litgpt import pretrain as litgpt_pretrain
    from litgpt.args import EvalArgs, TrainArgs

    logger = Losses()
    f = fabric(strategy_kwargs, logger)
    if fabrics is not None:
        fabrics.append(f)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    train = TrainArgs(
        save_interval=save_interval, log_interval=1, global_batch_size=micro_batch_size * accumulate * data_parallel,
        micro_batch_size=micro_batch_size, max_tokens=iters * micro_batch_size * SEQ * f.world_size, max_norm=1.0,
        min_lr=1e-4, lr_warmup_steps=1, tie_embeddings=False,
    )
    # on one device litgpt compiles the model; eager here (Inductor's CPU attention backward fails in float64)
    eager = torch.compiler.set_stance("force_eager") if strategy_kwargs is None else contextlib.nullcontext()
    with cli_args("tiny"), eager:
        litgpt_pretrain.main(
            f, devices=data_parallel, seed=7, initial_checkpoint_dir=None, resume=resume,
            config=config or neox_config(), data=TextBytes(write_text(directory)), out_dir=directory / "out",
            tokenizer_dir=None, tokenizer=None, train=train, eval=EvalArgs(interval=1000, max_iters=1,
                                                                            final_validation=False),
            optimizer={"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.02, "weight_decay": 0.01}},
        )
    return logger.values()


# --- finetuning: a checkpoint directory and a JSON instruction file the test writes ------------------------------

INSTRUCTIONS = [
    {"instruction": f"Explain in plain words what step {i} of tensor parallel training does to the weights of block "
                    f"{i % 3}.",
     "input": "",
     "output": f"Step {i} splits the weights of block {i % 3} over the ranks and sums their partial outputs."}
    for i in range(16)
]


def write_checkpoint_dir(directory: Path, config, lora: bool) -> Path:
    """lit_model.pth (seeded weights; for LoRA with nonzero lora_B), model_config.yaml, and a small tokenizer trained
    on the instructions (tokenizer.json, tokenizer_config.json)."""
    import json

    from litgpt import GPT
    from litgpt.lora import GPT as LoRAGPT
    from litgpt.utils import save_config
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(3)
    with torch.device("cpu"):
        model = (LoRAGPT if lora else GPT)(config).double()
    for name, p in model.named_parameters():
        if "lora_B" in name:  # litgpt starts it at zero: nonzero, so that every LoRA parameter trains from step 1
            torch.nn.init.normal_(p, std=0.05)
    torch.save(model.state_dict(), directory / "lit_model.pth")
    save_config(config, directory)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    text = [TEXT, *(" ".join(d.values()) for d in INSTRUCTIONS), "Below is an instruction that describes a task. "
            "Write a response that appropriately completes the request. ### Instruction: ### Response:"]
    tokenizer.train_from_iterator(text, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"]))
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                                 "tokenizer_class": "PreTrainedTokenizerFast"}))
    (directory / "instructions.json").write_text(json.dumps(INSTRUCTIONS))
    return directory


def finetune(kind: str, checkpoint_dir: str, out_dir: str, strategy_kwargs: dict | None, config, *, steps: int = 3,
             accumulate: int = 2, cli: tuple[str, ...] = ()) -> list[float]:
    """litgpt.finetune.full.main or litgpt.finetune.lora.main for `steps` optimizer steps; the losses it logged."""
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.data import JSON

    logger = Losses()
    f = fabric(strategy_kwargs, logger)
    checkpoint_dir = Path(checkpoint_dir)
    data = JSON(checkpoint_dir / "instructions.json", val_split_fraction=0.25, num_workers=0)
    train = TrainArgs(save_interval=None, log_interval=1, global_batch_size=2 * accumulate, micro_batch_size=2,
                      lr_warmup_steps=1, epochs=5, max_steps=steps, max_seq_length=SEQ)
    # max_new_tokens beyond the sequence length: litgpt skips the sample it would generate on rank 0 alone
    evaluation = EvalArgs(interval=1000, max_new_tokens=1000, max_iters=1, initial_validation=False,
                          final_validation=False)
    optimizer = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.02, "weight_decay": 0.01}}
    if kind == "full":
        from litgpt.finetune import full as script

        arguments = dict(resume=False)
    else:
        from litgpt.finetune import lora as script

        arguments = dict(precision="64-true")
    with cli_args(str(checkpoint_dir), *cli):
        script.main(f, devices=1, seed=5, config=config, data=data, checkpoint_dir=checkpoint_dir,
                    out_dir=Path(out_dir), train=train, eval=evaluation, optimizer=optimizer, **arguments)
    return logger.values()


# --- the idioms of Lightning's docs: fabric.setup(model, optimizer) and a hand-written loop -----------------------

INITS = ("plain", "init_module", "meta")


def build_gpt(f, init: str, config=None):
    """A litgpt GPT built as a user would: "plain" (`GPT(config)`), "init_module" (under `fabric.init_module()`) or
    "meta" (under `fabric.init_module(empty_init=True)`); on one device "meta" is initialized as ThunderTPStrategy
    initializes it: each module's reset_parameters in module order."""
    from litgpt import GPT
    from litgpt.utils import reset_parameters

    config = config or neox_config()
    if init == "plain":
        return GPT(config)
    if init == "meta" and f.world_size == 1:  # one device: Fabric's empty_init would leave the memory uninitialized
        with f.init_module(), torch.device("meta"):
            model = GPT(config)
        model.to_empty(device=f.device)
        reset_parameters(model)
        return model
    with f.init_module(empty_init=init == "meta"):
        return GPT(config)


def two_group_adamw(model) -> torch.optim.Optimizer:
    """AdamW with two param groups of their own options: the matrices decayed, the vectors not, at another lr."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([
        {"params": matrices, "weight_decay": 0.1},
        {"params": vectors, "weight_decay": 0.0, "lr": 0.01, "betas": (0.8, 0.95)},
    ], lr=0.02)


def token_batch(rows: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and their next tokens."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (rows, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train_as_in_the_docs(strategy_kwargs: dict | None, init: str, *, rows: int = 2, steps: int = 3,
                         seed: int = 11, rank_batches_from: int | None = None) -> dict:
    """`model, optimizer = fabric.setup(model, optimizer)` with the optimizer built before setup, then a plain loop
    (forward, cross-entropy, fabric.backward, optimizer.step) on one batch of `rows` rows (the loss falls step by
    step); each data-parallel rank takes its share of the rows. From step `rank_batches_from` on, every rank draws its
    own batch (the bug the input check catches).
    Returns the losses, the full parameters at the end and the optimizer's options and state shapes; or the losses
    so far, the error and the step where a call with the rank's own batch raised."""
    import torch.nn.functional as F

    f = fabric(strategy_kwargs, Losses())
    f.seed_everything(seed)
    model = build_gpt(f, init)
    optimizer = two_group_adamw(model)
    model, optimizer = f.setup(model, optimizer)
    dp, dp_rank = (f.strategy.mesh.dp, f.strategy.mesh.dp_rank) if strategy_kwargs is not None else (1, 0)
    losses = []
    for step in range(steps):
        own = rank_batches_from is not None and step >= rank_batches_from
        idx, targets = token_batch(rows=rows, seed=f.global_rank + 1 if own else 0)
        mine = slice(dp_rank * rows // dp, (dp_rank + 1) * rows // dp)
        try:
            logits = model(idx[mine])
        except RuntimeError as e:
            if not own:
                raise
            return {"losses": losses, "error": str(e), "failed_step": step}
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[mine].reshape(-1))
        f.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(f.all_reduce(loss.detach(), reduce_op="mean").item())
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    held = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"]]
    moments = [tuple(optimizer.state[p]["exp_avg"].shape) for g in optimizer.param_groups for p in g["params"]]
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "groups": groups, "held": held, "moments": moments}
