"""A model of your own for ``harness bench --model examples.own_model:tiny_gpt`` (docs/models.md).

Any ``nn.Module`` that maps ``(B, T)`` token ids to ``(B, T, vocab)`` logits will do; the factory returns it with
the class of its repeated block, the vocabulary and the sequence length (and, to shard it by tensor parallel, a
``tp_plan``). This one is a small pre-norm GPT written with torch's own layers.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

VOCAB, SEQ, WIDTH, HEADS, LAYERS = 256, 64, 64, 4, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, -1, WIDTH // HEADS).transpose(1, 2) for y in self.qkv(self.ln1(x)).chunk(3, dim=-1))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, -1))
        return x + self.down(nn.functional.gelu(self.up(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(SEQ, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def tiny_gpt() -> dict:
    """The model, its block class, its vocabulary and sequence, and how tensor parallel shards it: the MLP's up
    projection column-wise, its down projection row-wise (the attention stays whole on every rank)."""
    torch.manual_seed(0)
    plan = {f"layers.{i}.{name}": style() for i in range(LAYERS)
            for name, style in (("up", ColwiseParallel), ("down", RowwiseParallel))}
    return {"model": TinyGPT(), "block": Block, "vocab_size": VOCAB, "seq_len": SEQ, "tp_plan": plan}
