"""Small torch models for the planner's tracing tests (built on whatever device is current)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # plan_models: the benchmark's models


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 100, hidden: int = 32, heads: int = 4, blocks: int = 2) -> None:
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


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16 * 4 * 4, 32), nn.ReLU(),
                         nn.Linear(32, 10))


def not_a_model() -> int:
    return 3


def sp_mlp() -> nn.Module:
    """Megatron-SP's shape on (batch, sequence, 8) activations: column, row, a LayerNorm, column, row."""
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.LayerNorm(8), nn.Linear(8, 16), nn.ReLU(),
                         nn.Linear(16, 8))


def wide_mlp() -> nn.Module:
    """4.2M parameters on (batch, 512) inputs: gradients dear to all-reduce over a slow link, activations cheap."""
    return nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512), nn.GELU(), nn.Linear(512, 2048),
                         nn.GELU(), nn.Linear(2048, 512))


def vgg() -> nn.Module:
    """VGG's shape, small: a convolution stack (few parameters, large activations) and a heavy fully connected
    classifier (1.6M parameters, small activations) on (batch, 3, 16, 16) images — AutoDDL's mixed plans."""
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 4 * 4, 1024), nn.ReLU(),
                         nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def split_gpt() -> nn.Module:
    """A GPT whose attention projections are separate Linear layers, so DTensor can split it by heads
    (benchmarks/plan_models.py's, small): traced through, Megatron makes q, k, v column layers and the
    output projection their row partner."""
    from plan_models import GPT

    return GPT(vocab=64, hidden=16, heads=4, blocks=2)


def transformer_encoder() -> nn.Module:
    """The issue's model: torch's own nn.TransformerEncoder as a new user first writes it — sequence-first
    (torch's default: (sequence, batch, features)), packed attention projections, dropout 0.1."""
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(512, 8), 2)


def small_encoder() -> nn.Module:
    """nn.TransformerEncoder small, sequence-first as torch builds it by default, without dropout (so 2
    ranks can train it like one process; no nested tensors: torch warns a sequence-first one cannot use them)."""
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0), 2,
                                 enable_nested_tensor=False)


class EncoderDecoder(nn.Module):
    """nn.TransformerDecoder over nn.TransformerEncoder's memory of the same batch (batch-first): the
    decoder's cross-attention takes two inputs, its query and the memory."""

    def __init__(self, hidden: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(hidden, heads, 2 * hidden, dropout=0.0, batch_first=True), 1,
            enable_nested_tensor=False)
        self.decoder = nn.TransformerDecoder(
            nn.TransformerDecoderLayer(hidden, heads, 2 * hidden, dropout=0.0, batch_first=True), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(x, self.encoder(x))


class SelfAttention(nn.Module):
    """nn.MultiheadAttention as torch builds it by default: sequence-first, its q, k and v projections
    packed in one in_proj_weight; called for its weights too (need_weights defaults to True)."""

    def __init__(self, hidden: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(hidden, heads)
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x + self.attn(x, x, x)[0])


class CrossAttention(nn.Module):
    """nn.MultiheadAttention with keys and values of other widths than its queries (kdim, vdim: separate,
    unpacked projections), attending from the batch's features to a projection of them."""

    def __init__(self, hidden: int = 32, heads: int = 4, kv: int = 24) -> None:
        super().__init__()
        self.memory = nn.Linear(hidden, kv)
        self.attn = nn.MultiheadAttention(hidden, heads, kdim=kv, vdim=kv, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.memory(x)
        return self.attn(x, m, m, need_weights=False)[0]
