"""The Python code blocks of README.md and docs/*.md, and how the doc tests run them.

Every ```python block is preceded by a marker line saying how it runs:

    <!-- doc-test: torchrun 2 -->                a complete script for `torchrun --nproc-per-node 2`
    <!-- doc-test: torchrun 2 after litgpt -->   a fragment, run after the prelude `litgpt` (below) on 2 ranks
    <!-- doc-test: plain after litgpt-nodist --> a fragment run in one plain process (no process group)
    <!-- doc-test: skip: the reason -->          not run, and why
    <!-- doc-test: torchrun 2 after hf; slow: tests/test_hf.py runs the same -->
                                                 run only with the slow tests: a test of the suite runs the same

A block for torchrun runs on the ranks of tests/dist.py's gloo pools, which already joined a process group: its own
`init_process_group` / `destroy_process_group` calls are no-ops there (the group it would create is the pool's). Each
block runs in a fresh working directory shared by its ranks, so relative paths ("ckpt/step100") stay inside it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_MARKER = re.compile(r"<!-- doc-test: (?P<how>.+?) -->")
_HOW = re.compile(r"(?P<runner>torchrun (?P<ranks>\d+)|plain)(?: after (?P<prelude>[\w-]+))?$")

#: the context fragments run after: what a reader has built before the block (tiny sizes, same names)
PRELUDES = {
    "mlp": '''
import thunder, torch, torch.distributed as dist, torch.nn as nn
import thunder_tp
from thunder_tp import ColwiseParallel, RowwiseParallel, TensorParallel
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
''',
    "litgpt-nodist": '''
import litgpt, litgpt.generate.base, thunder, torch
import thunder_tp
from litgpt import GPT, Config
from thunder_tp import TensorParallel
torch.manual_seed(0)
config = Config(name="doc-llama", block_size=256, vocab_size=128, padded_vocab_size=128, n_layer=2, n_head=8,
                n_query_groups=8, n_embd=64, intermediate_size=128, bias=False, parallel_residual=False,
                rotary_percentage=1.0, mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm")
model = GPT(config)
idx, targets = torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16))
example_args, example_kwargs = (idx,), {}
plan = thunder_tp.plans.litgpt(model)
prompt, max_returned_tokens = torch.tensor([1, 2, 3, 4]), 12
''',
}
PRELUDES["litgpt"] = PRELUDES["litgpt-nodist"] + '''
import torch.distributed as dist
dist.init_process_group("gloo")
'''
PRELUDES["litgpt-jitted"] = PRELUDES["litgpt"] + '''
jm = thunder.jit(model, transforms=[TensorParallel(plan)], executors=thunder_tp.executors())
optimizer = torch.optim.SGD(jm.parameters(), lr=0.1)
torch.nn.functional.cross_entropy(jm(idx).flatten(0, 1), targets.flatten()).backward()
optimizer.step()
if dist.get_rank() == 0:
    torch.save(GPT(config).state_dict(), "lit_model.pth")
dist.barrier()
'''
PRELUDES["hf"] = '''
import thunder, torch, torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig
import thunder_tp
from thunder_tp import TensorParallel
dist.init_process_group("gloo")
torch.manual_seed(0)
config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256)
idx = torch.randint(0, 256, (2, 16))
if dist.get_rank() == 0:
    AutoModelForCausalLM.from_config(config).save_pretrained("path/to/hf_dir")
dist.barrier()
'''


@dataclass(frozen=True)
class Block:
    """One ```python block: where it is, how it runs (None: skipped, with `reason`), and its code."""

    where: str
    code: str
    ranks: int | None = None
    prelude: str = ""
    reason: str = ""
    #: which test of the default run does what the block does (the block then runs with the slow tests)
    slow: str = ""

    @property
    def runs(self) -> bool:
        return not self.reason

    def script(self) -> str:
        """The code to run: the prelude's, then the block's."""
        return PRELUDES[self.prelude] + self.code if self.prelude else self.code


def blocks() -> list[Block]:
    """Every ```python block of the README and docs, with its marker read (a block without one is an error)."""
    found = []
    for path in DOCUMENTS:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() == "```python":
                end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
                where = f"{path.relative_to(REPO)}:{i + 1}"
                found.append(_block(where, "\n".join(lines[i + 1:end]) + "\n", lines[i - 1] if i else ""))
    return found


def _block(where: str, code: str, previous: str) -> Block:
    marker = _MARKER.fullmatch(previous.strip())
    if marker is None:
        raise ValueError(f"{where}: a ```python block needs a `<!-- doc-test: ... -->` line before it")
    how, _, slow = marker["how"].partition("; slow:")
    if how.startswith("skip:"):
        return Block(where, code, reason=how.removeprefix("skip:").strip() or "no reason given")
    parsed = _HOW.fullmatch(how)
    if parsed is None or (parsed["prelude"] and parsed["prelude"] not in PRELUDES):
        raise ValueError(f"{where}: unknown doc-test marker {how!r}")
    ranks = int(parsed["ranks"]) if parsed["ranks"] else None
    return Block(where, code, ranks, parsed["prelude"] or "", slow=slow.strip())


def run_on_rank(script: str, directory: str) -> None:
    """Run a block's script on this rank of a pool (its process group already joined), in `directory`."""
    import os

    import torch.distributed as dist

    joined = (dist.init_process_group, dist.destroy_process_group)
    dist.init_process_group = dist.destroy_process_group = lambda *args, **kwargs: None
    cwd = os.getcwd()
    os.chdir(directory)
    try:
        exec(compile(script, "<doc block>", "exec"), {"__name__": "__doc_block__"})
    finally:
        os.chdir(cwd)
        dist.init_process_group, dist.destroy_process_group = joined
        dist.barrier()
