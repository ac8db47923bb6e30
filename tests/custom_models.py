"""Models nobody wrote a TP plan for (plans.auto's tests): an MLP stack, a ViT-style encoder, a T5-style
encoder-decoder with cross-attention, and a conv stem feeding a transformer. Each returns a scalar loss."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

DIM, HEADS, BATCH, SEQ, VOCAB = 64, 4, 2, 16, 128


class MLPStack(nn.Module):
    """Linear / GELU / Linear blocks with residuals, then a 10-way classifier."""

    def __init__(self, layers: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
                                    for _ in range(layers))
        self.head = nn.Linear(DIM, 10)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return F.cross_entropy(self.head(x), labels)


class Attention(nn.Module):
    """Multi-head attention with separate q/k/v projections; self-attention, or cross-attention over `memory`. The key
    projection has no bias (as Whisper's): the softmax ignores it, so its grad would be round-off."""

    def __init__(self, causal: bool):
        super().__init__()
        self.q, self.v, self.out = (nn.Linear(DIM, DIM) for _ in range(3))
        self.k = nn.Linear(DIM, DIM, bias=False)
        self.causal = causal

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        memory = x if memory is None else memory
        def heads(t):
            return t.view(*t.shape[:2], HEADS, DIM // HEADS).transpose(1, 2)
        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(memory)), heads(self.v(memory)),
                                           is_causal=self.causal)
        return self.out(y.transpose(1, 2).reshape(x.shape))


class Block(nn.Module):
    """Pre-norm transformer block; a decoder block adds cross-attention over the encoder's output."""

    def __init__(self, causal: bool = False, cross: bool = False):
        super().__init__()
        self.norm_1, self.norm_2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention(causal)
        self.cross = Attention(False) if cross else None
        self.norm_c = nn.LayerNorm(DIM) if cross else None
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x))
        if self.cross is not None:
            x = x + self.cross(self.norm_c(x), memory)
        return x + self.mlp(self.norm_2(x))


class ViT(nn.Module):
    """Patches (flattened 4x4x3 pixels) embedded by a Linear, a class token, two encoder blocks, a classifier."""

    def __init__(self, patches: int = SEQ):
        super().__init__()
        self.embed = nn.Linear(48, DIM)
        self.cls = nn.Parameter(torch.randn(1, 1, DIM))
        self.pos = nn.Parameter(torch.randn(1, patches + 1, DIM))
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, 10)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.norm(x)[:, 0]

    def forward(self, patches: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.features(self.embed(patches))), labels)


class ConvViT(ViT):
    """A conv stem (two 3x3 convolutions, then 4x4 patches) feeding the ViT's transformer."""

    def __init__(self):
        super().__init__(patches=16)
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, DIM, 4, stride=4))
        del self.embed

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.stem(images).flatten(2).transpose(1, 2)
        return F.cross_entropy(self.head(self.features(x)), labels)


class T5(nn.Module):
    """Encoder-decoder: a shared embedding, two encoder blocks, two decoder blocks with causal self-attention and
    cross-attention, an LM head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.encoder = nn.ModuleList(Block() for _ in range(2))
        self.decoder = nn.ModuleList(Block(causal=True, cross=True) for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, source: torch.Tensor, target: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        memory = self.embed(source)
        for block in self.encoder:
            memory = block(memory)
        x = self.embed(target)
        for block in self.decoder:
            x = block(x, memory)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def inputs(name: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Example inputs of each model, float64."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (BATCH,), generator=g)
    def tokens():
        return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return {
        "mlp": lambda: (torch.randn(BATCH, DIM, generator=g, dtype=torch.float64), labels),
        "vit": lambda: (torch.randn(BATCH, SEQ, 48, generator=g, dtype=torch.float64), labels),
        "conv_vit": lambda: (torch.randn(BATCH, 3, 16, 16, generator=g, dtype=torch.float64), labels),
        "t5": lambda: (tokens(), tokens(), tokens()),
    }[name]()


MODELS = {"mlp": MLPStack, "vit": ViT, "conv_vit": ConvViT, "t5": T5}


def naive_plan(model: nn.Module) -> dict:
    """Every Linear column-parallel with its output gathered right away (activations replicated around each)."""
    from thunder_tp import ColwiseParallel, Replicate

    return {n: ColwiseParallel(output_layout=Replicate()) for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and m.out_features % 4 == 0}
