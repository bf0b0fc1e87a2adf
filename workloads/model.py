"""Pre-norm decoders of both families (:mod:`workloads.sizes`), one module tree for every strategy.

* ``gpt2``: LayerNorm, learned positions, 4x GELU MLP, multi-head attention, biases.
* ``llama3``: RMSNorm, rotary positions (theta 500,000) applied per head to q and k, SwiGLU MLP
  (``gate``, ``up``, ``down``-as-``proj``), grouped-query attention (``n_kv_heads`` k/v heads shared
  by groups of query heads: SDPA's ``enable_gqa``), no biases.

The module tree is shaped for parallelism:

* attention projections are separate ``q``/``k``/``v``/``out`` linears so tensor parallel
  can shard them column- and row-wise; the attention reshapes by ``head_dim`` (not by the
  head count) so a rank holding ``n_heads / tp`` query and ``n_kv_heads / tp`` key/value heads
  needs no special case;
* the MLP's column-parallel inputs are ``fc`` (gpt2) or ``gate`` and ``up`` (llama3), its
  row-parallel output ``proj`` in both (:mod:`harness.parallel.tp` shards by these names);
* blocks live in a ``ModuleDict`` keyed by layer index so a pipeline stage that drops
  layers keeps the original parameter names;
* ``embed``, ``norm`` and ``head`` may be ``None`` on pipeline stages that do not own them;
* RoPE's angles are computed in each attention from the positions of the tokens it sees, so a
  pipeline stage, a checkpointed or compiled block needs no table passed in;
* ``seq_shard`` (on ``Embeddings`` and ``Attention``): None for a whole sequence; under context
  parallel the harness attaches an object whose ``positions(local_len, device)`` gives the global
  positions of the tokens this rank holds and whose ``attention(q, k, v)`` attends them causally over
  the whole sequence's keys and values (``harness.parallel.cp``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workloads.layers import SwiGLU, positions_of
from workloads.moe import MoE
from workloads.sizes import ModelSize


class Embeddings(nn.Module):
    seq_shard = None

    def __init__(self, vocab_size: int, seq_len: int | None, d_model: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model) if seq_len else None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok(idx)  # (B, T, C)
        if self.pos is None:
            return h
        return h + self.pos(positions_of(self.seq_shard, idx.shape[1], idx.device))


def rope_angles(positions: int | torch.Tensor, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of RoPE's angles (Su et al. 2021), ``(T, head_dim / 2)`` each, in fp32, at ``positions``
    (a tensor of positions, or T for ``0..T-1``)."""
    if isinstance(positions, int):
        positions = torch.arange(positions, device=device)
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(positions.to(device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (even, odd) pair of ``x`` (B, H, T, hd) by its position's angle, as Meta's reference does."""
    pairs = x.float().unflatten(-1, (-1, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    out = torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    seq_shard = None

    def __init__(self, size: ModelSize) -> None:
        super().__init__()
        d, bias = size.d_model, not size.llama
        self.head_dim = size.head_dim
        self.rope_theta = size.rope_theta if size.llama else None
        self.q = nn.Linear(d, size.q_dim, bias=bias)
        self.k = nn.Linear(d, size.kv_dim, bias=bias)
        self.v = nn.Linear(d, size.kv_dim, bias=bias)
        self.out = nn.Linear(size.q_dim, d, bias=bias)
        qk_norm = size.qk_norm
        self.q_norm = nn.RMSNorm(self.head_dim, eps=size.norm_eps) if qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=size.norm_eps) if qk_norm else None

    def core(self, x: torch.Tensor) -> torch.Tensor:
        """Projections and attention, before the output projection: what selective activation
        checkpointing recomputes (its q, k, v and attention output are not kept for backward)."""
        b, t, _ = x.shape
        # (B, T, H_local * hd) -> (B, H_local, T, hd); H_local = H / tp under tensor parallel
        q = self.q(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (qk_norm)
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_theta is not None:
            cos, sin = rope_angles(positions_of(self.seq_shard, t, x.device), self.head_dim, self.rope_theta, x.device)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.seq_shard is not None:
            y = self.seq_shard.attention(q, k, v)
        else:
            gqa = k.shape[1] != q.shape[1]
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)  # (B, H_local, T, hd)
        return y.transpose(1, 2).reshape(b, t, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.core(x))


class MLP(nn.Module):
    """gpt2's 4x GELU MLP."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, d_ff)
        self.proj = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


def _norm(size: ModelSize) -> nn.Module:
    return nn.RMSNorm(size.d_model, eps=size.norm_eps) if size.llama else nn.LayerNorm(size.d_model)


class Block(nn.Module):
    def __init__(self, size: ModelSize) -> None:
        super().__init__()
        self.ln1 = _norm(size)
        self.attn = Attention(size)
        self.ln2 = _norm(size)
        if size.moe is not None:
            self.mlp: nn.Module = MoE(size.d_model, size.moe)
        else:
            self.mlp = SwiGLU(size.d_model, size.d_ff) if size.llama else MLP(size.d_model, size.d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Decoder(nn.Module):
    """Decoder-only transformer of either family. ``forward(idx)`` returns logits ``(B, T, V)``."""

    def __init__(self, size: ModelSize) -> None:
        super().__init__()
        self.size = size
        pos = size.seq_len if size.learned_positions else None
        self.embed: Embeddings | None = Embeddings(size.vocab_size, pos, size.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(size) for i in range(size.n_layers)})
        self.norm: nn.Module | None = _norm(size)
        self.head: nn.Linear | None = nn.Linear(size.d_model, size.vocab_size, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 init for both families: N(0, 0.02), residual projections scaled by 1/sqrt(2L)."""
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 1:
                if name.endswith("weight"):
                    nn.init.ones_(p)
                else:
                    nn.init.zeros_(p)
            elif name.endswith(("attn.out.weight", "mlp.proj.weight", "experts.proj", "shared.proj.weight")):
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
