"""The four model families of the planner's benchmark (``benchmarks/planner.py``), as ``commd plan``
takes them: ``plan_models:FACTORY`` with ``PYTHONPATH=benchmarks``.

- ``wide_mlp`` (input 64x512): 4.2 M parameters, small activations — gradients dear to all-reduce,
  activations cheap: tensor parallel should win over a slow link.
- ``narrow_mlp`` (input 4096x256): 0.26 M parameters, a large batch — activations dear: data parallel.
- ``vgg`` (input 32x3x32x32): a VGG-like convolution stack (0.29 M parameters) and a heavy classifier
  (8.4 M): AutoDDL's case for data-parallel convolutions and a tensor-parallel classifier.
- ``gpt`` (input 8x64 token ids): 4 blocks, hidden 256, 8 heads, attention with separate q, k, v and
  output projections (so DTensor can split it by heads), vocabulary 2048.
"""

from __future__ import annotations

import torch
from torch import nn

#: Per factory, the input ``commd plan`` traces it with (and its dtype).
INPUTS = {"wide_mlp": ("64x512", "float32"), "narrow_mlp": ("4096x256", "float32"),
          "vgg": ("32x3x32x32", "float32"), "gpt": ("8x64", "int64")}


def wide_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512), nn.GELU(), nn.Linear(512, 2048),
                         nn.GELU(), nn.Linear(2048, 512))


def narrow_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256),
                         nn.GELU(), nn.Linear(256, 256))


def vgg() -> nn.Module:
    def stage(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU(),
                nn.MaxPool2d(2)]

    return nn.Sequential(*stage(3, 32), *stage(32, 64), *stage(64, 64), nn.Flatten(),
                         nn.Linear(64 * 4 * 4, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                         nn.Linear(2048, 10))


class SelfAttention(nn.Module):
    """Causal self-attention of separate projections (sizes by -1: each rank's view holds its heads)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = SelfAttention(hidden, heads)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 2048, hidden: int = 256, heads: int = 8, blocks: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(blocks))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt() -> nn.Module:
    return GPT()
