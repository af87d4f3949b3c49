"""A small pre-LayerNorm transformer classifier built only from layers Opacus supports.

Attention is ``nn.Linear`` projections + ``F.scaled_dot_product_attention`` (no
``nn.MultiheadAttention``), so per-sample-gradient methods and zeroth-order methods run on the
very same model, for a fair comparison of their cost (``benchmarks/step_cost.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _Block(nn.Module):
    def __init__(self, width: int, heads: int, mlp_ratio: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, mlp_ratio * width), nn.GELU(), nn.Linear(mlp_ratio * width, width))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, w)
        x = x + self.dropout(self.proj(attn))
        return x + self.dropout(self.mlp(self.norm2(x)))


class TinyTransformerClassifier(nn.Module):
    """Token ids ``[B, T]`` → class logits ``[B, num_classes]`` (mean-pooled final states).

    The defaults (vocabulary 2,000, width 256, 4 layers, 4 heads, length 64) give 3.7M parameters,
    the reference model of the step-cost benchmark.
    """

    def __init__(
        self,
        vocab_size: int = 2000,
        width: int = 256,
        depth: int = 4,
        heads: int = 4,
        max_length: int = 64,
        num_classes: int = 2,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.position = nn.Embedding(max_length, width)
        self.blocks = nn.Sequential(*[_Block(width, heads, dropout=dropout) for _ in range(depth)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # expanded to [B, T] so that per-sample-gradient hooks see the batch dimension
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        x = self.blocks(self.embed(tokens) + self.position(positions))
        return self.head(self.norm(x).mean(dim=1))
