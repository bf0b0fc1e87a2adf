"""A GPT-style decoder: pre-LayerNorm blocks, causal SDPA attention, 4x GELU MLP, untied LM head.

The module tree is shaped for parallelism:

* attention projections are separate ``q``/``k``/``v``/``out`` linears so tensor parallel
  can shard them column- and row-wise; the attention reshapes by ``head_dim`` (not by the
  head count) so a rank holding ``n_heads / tp`` heads needs no special case;
* blocks live in a ``ModuleDict`` keyed by layer index so a pipeline stage that drops
  layers keeps the original parameter names;
* ``embed``, ``norm`` and ``head`` may be ``None`` on pipeline stages that do not own them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workloads.sizes import ModelSize


class Embeddings(nn.Module):
    def __init__(self, vocab_size: int, seq_len: int, d_model: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        return self.tok(idx) + self.pos(pos)  # (B, T, C)


class Attention(nn.Module):
    def __init__(self, d_model: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)

    def core(self, x: torch.Tensor) -> torch.Tensor:
        """Projections and attention, before the output projection: what selective activation
        checkpointing recomputes (its q, k, v and attention output are not kept for backward)."""
        b, t, _ = x.shape
        # (B, T, H_local * hd) -> (B, H_local, T, hd); H_local = H / tp under tensor parallel
        q = self.q(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H_local, T, hd)
        return y.transpose(1, 2).reshape(b, t, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.core(x))


class MLP(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, d_ff)
        self.proj = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, size: ModelSize) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(size.d_model)
        self.attn = Attention(size.d_model, size.head_dim)
        self.ln2 = nn.LayerNorm(size.d_model)
        self.mlp = MLP(size.d_model, size.d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer. ``forward(idx)`` returns logits ``(B, T, V)``."""

    def __init__(self, size: ModelSize) -> None:
        super().__init__()
        self.size = size
        self.embed: Embeddings | None = Embeddings(size.vocab_size, size.seq_len, size.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(size) for i in range(size.n_layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(size.d_model)
        self.head: nn.Linear | None = nn.Linear(size.d_model, size.vocab_size, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2L)."""
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 1:
                if name.endswith("weight"):
                    nn.init.ones_(p)
                else:
                    nn.init.zeros_(p)
            elif name.endswith(("attn.out.weight", "mlp.proj.weight")):
                nn.init.normal_(p, std=std / (2 * self.size.n_layers) ** 0.5)
            else:
                nn.init.normal_(p, std=std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # On a pipeline stage without the embedding, x is already the hidden state (B, T, C).
        h = self.embed(x) if self.embed is not None else x
        for block in self.blocks.values():
            h = block(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.head(h) if self.head is not None else h


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy in nats; computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
