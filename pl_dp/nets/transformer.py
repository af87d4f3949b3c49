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

    def forward(self, x: torch.Tensor, keys: torch.Tensor | None = None) -> torch.Tensor:
        """``keys``: ``[B, 1, 1, T]`` booleans, True where a position may be attended to (None: everywhere)."""
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=keys).transpose(1, 2).reshape(b, t, w)
        x = x + self.dropout(self.proj(attn))
        return x + self.dropout(self.mlp(self.norm2(x)))


class TinyTransformerClassifier(nn.Module):
    """Token ids ``[B, T]`` → class logits ``[B, num_classes]`` (final states mean-pooled over each example's tokens).

    The defaults (vocabulary 2,000, width 256, 4 layers, 4 heads, length 64) give 3.7M parameters,
    the reference model of the step-cost benchmark.

    Padding: positions where ``attention_mask`` is 0 — or, without a mask, where the token is ``pad_token_id``
    (0, as :class:`~pl_dp.data.collate.PaddingCollate` pads token tuples; ``None``: no token is padding) — are
    never attended to and get weight 0 in the pooling. With right padding each example's logits are then those of
    its own tokens whatever the batch is padded to (up to float rounding), which per-example privacy needs: a
    padded batch's length is set by its longest sampled example.
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
        pad_token_id: int | None = 0,
    ) -> None:
        super().__init__()
        self.pad_token_id = pad_token_id
        self.embed = nn.Embedding(vocab_size, width)
        self.position = nn.Embedding(max_length, width)
        self.blocks = nn.ModuleList([_Block(width, heads, dropout=dropout) for _ in range(depth)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids) if self.pad_token_id is None else input_ids != self.pad_token_id
        own = attention_mask.bool()
        # expanded to [B, T] so that per-sample-gradient hooks see the batch dimension
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        x = self.embed(input_ids) + self.position(positions)
        keys = own[:, None, None, :]
        for block in self.blocks:
            x = block(x, keys)
        weights = own.unsqueeze(-1).to(x.dtype)
        return self.head((self.norm(x) * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1.0))
