"""The Megatron ParallelMLP-shaped block (fc1 column-parallel, GELU, fc2 row-parallel) that the core tests shard."""

import torch
import torch.nn as nn

import thunder_tp

SEQ, BATCH, HIDDEN, FFN = 32, 4, 128, 512
#: fc1 split by output features, fc2 by input features: one all_reduce per pass
PLAN = {"fc1": thunder_tp.ColwiseParallel(), "fc2": thunder_tp.RowwiseParallel()}


class MLP(nn.Module):
    """fc2(gelu(fc1(x))), hidden -> ffn -> hidden."""

    def __init__(self, hidden: int = HIDDEN, ffn: int = FFN, bias: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn, bias=bias)
        self.fc2 = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def mlp_input() -> tuple[torch.Tensor]:
    """The MLP's input, (seq, batch, hidden), requiring grad; the same on every call (seeded)."""
    torch.manual_seed(2)
    return (torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True),)
