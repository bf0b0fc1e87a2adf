"""Decoders of every architecture (:mod:`workloads.architecture`), one module tree for every strategy.

* ``gpt2``: LayerNorm, learned positions, 4x GELU MLP, multi-head attention, biases.
* ``llama3``: RMSNorm, rotary positions (theta 500,000) applied per head to q and k, SwiGLU MLP
  (``gate``, ``up``, ``down``-as-``proj``), grouped-query attention (``n_kv_heads`` k/v heads shared
  by groups of query heads: SDPA's ``enable_gqa``), no biases.
* A config model (``--model``) picks its parts: norms before or after each sub-layer, a parallel residual, biases,
  learned, rotary (whole or partial) or ALiBi positions, q/k norms per head or per projection, multi-head latent
  attention (:class:`LatentAttention`), dense or MoE blocks by layer.

The module tree is shaped for parallelism:

* attention projections are separate ``q``/``k``/``v``/``out`` linears so tensor parallel
  can shard them column- and row-wise; the attention reshapes by ``head_dim`` (not by the
  head count) so a rank holding ``n_heads / tp`` query and ``n_kv_heads / tp`` key/value heads
  needs no special case; under MLA the up-projections ``q_b`` (or ``q``) and ``kv_b`` are the column-parallel ones,
  the low-rank down-projections ``q_a`` and ``kv_a`` stay whole on every rank;
* the MLP's column-parallel inputs are ``fc`` (gpt2) or ``gate`` and ``up`` (llama3), its
  row-parallel output ``proj`` in both (:mod:`harness.parallel.tp` shards by these names);
* blocks live in a ``ModuleDict`` keyed by layer index so a pipeline stage that drops
  layers keeps the original parameter names;
* ``embed``, ``norm`` and ``head`` may be ``None`` on pipeline stages that do not own them;
* RoPE's angles and ALiBi's biases are computed in each attention from the positions of the tokens it sees, so a
  pipeline stage, a checkpointed or compiled block needs no table passed in; ALiBi's slopes are those of the heads a
  rank holds (``tp_rank``, set by tensor parallel);
* ``seq_shard`` (on ``Embeddings`` and the attentions): None for a whole sequence; under context
  parallel the harness attaches an object whose ``positions(local_len, device)`` gives the global
  positions of the tokens this rank holds and whose ``attention(q, k, v, slopes)`` attends them causally over
  the whole sequence's keys and values (``harness.parallel.cp``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workloads.architecture import ModelSize
from workloads.layers import ProjNorm, SwiGLU, alibi_bias, alibi_slopes, positions_of, sum_grad_over
from workloads.moe import MoE


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


def rotate_part(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, width: int) -> torch.Tensor:
    """RoPE on the first ``width`` of each head's ``x`` (B, H, T, hd), the rest as it is (GPT-NeoX's partial rotary)."""
    if width == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat((apply_rope(x[..., :width], cos, sin), x[..., width:]), dim=-1)


class _Positional(nn.Module):
    """What both attentions share: the positions of the tokens they see, RoPE's angles, ALiBi's slopes, and causal
    attention over the whole sequence or a context-parallel shard of it."""

    seq_shard = None
    tp_rank = 0
    """This rank's index in its tensor-parallel group: which of ALiBi's heads it holds."""
    alibi: torch.Tensor | None
    sdpa = staticmethod(F.scaled_dot_product_attention)
    """The attention kernel; the op-by-op what-if traces the block with a stand-in for the GPU's fused kernel
    (:mod:`harness.model.op_trace`)."""

    def _setup_positions(self, size: ModelSize) -> None:
        self.rope_theta = size.rope_theta
        self.rotary_dim = size.rotary_dim
        if size.positions == "alibi":
            self.register_buffer("alibi", alibi_slopes(size.n_heads), persistent=False)
        else:
            self.alibi = None

    def _angles(self, t: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_angles(positions_of(self.seq_shard, t, device), self.rotary_dim, self.rope_theta, device)

    def _local_slopes(self, heads: int) -> torch.Tensor | None:
        if self.alibi is None:
            return None
        return self.alibi[self.tp_rank * heads:(self.tp_rank + 1) * heads]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of q (B, Hq, T, E) over k (B, Hkv, T, E) and v (B, Hkv, T, Ev): (B, Hq, T, Ev)."""
        slopes = self._local_slopes(q.shape[1])
        if self.seq_shard is not None:
            return self.seq_shard.attention(q, k, v, slopes)
        gqa = k.shape[1] != q.shape[1]
        if slopes is None:
            return self.sdpa(q, k, v, is_causal=True, enable_gqa=gqa)
        pos = torch.arange(q.shape[2], device=q.device)
        return self.sdpa(q, k, v, attn_mask=alibi_bias(slopes, pos, pos, q.dtype), enable_gqa=gqa)


class Attention(_Positional):
    def __init__(self, size: ModelSize) -> None:
        super().__init__()
        d, bias = size.d_model, size.bias
        qkv_bias = size.bias or size.qkv_bias
        self.head_dim = size.head_dim
        self._setup_positions(size)
        self.q = nn.Linear(d, size.q_dim, bias=qkv_bias)
        self.k = nn.Linear(d, size.kv_dim, bias=qkv_bias)
        self.v = nn.Linear(d, size.kv_dim, bias=qkv_bias)
        self.out = nn.Linear(size.q_dim, d, bias=bias)
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if size.qk_norm == "head":
            self.q_norm, self.k_norm = nn.RMSNorm(self.head_dim, eps=size.norm_eps), nn.RMSNorm(self.head_dim,
                                                                                                eps=size.norm_eps)
        elif size.qk_norm == "proj":
            self.q_norm, self.k_norm = ProjNorm(size.q_dim, eps=size.norm_eps), ProjNorm(size.kv_dim, eps=size.norm_eps)
        self.norm_per_head = size.qk_norm == "head"

    def core(self, x: torch.Tensor) -> torch.Tensor:
        """Projections and attention, before the output projection: what selective activation
        checkpointing recomputes (its q, k, v and attention output are not kept for backward)."""
        b, t, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)  # (B, T, H_local * hd); H_local = H / tp under tensor parallel
        if self.q_norm is not None and self.k_norm is not None and not self.norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)  # over the whole projection (OLMo 2)
        q, k, v = (y.view(b, t, -1, self.head_dim).transpose(1, 2) for y in (q, k, v))  # (B, H_local, T, hd)
        if self.q_norm is not None and self.k_norm is not None and self.norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary_dim:
            cos, sin = self._angles(t, x.device)
            q, k = rotate_part(q, cos, sin, self.rotary_dim), rotate_part(k, cos, sin, self.rotary_dim)
        y = self.attend(q, k, v)  # (B, H_local, T, hd)
        return y.transpose(1, 2).reshape(b, t, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.core(x))


class LatentAttention(_Positional):
    """Multi-head latent attention (:class:`workloads.architecture.MLASpec`): q from ``q_b(q_a_norm(q_a(x)))`` (or
    ``q(x)``), k and v from ``kv_b(kv_a_norm(latent))`` where ``kv_a(x)`` gives the latent and the one rotary k head
    every head shares; causal attention of ``nope + rope`` wide q and k over ``v_dim`` wide values. Under tensor
    parallel a rank holds some heads: the shared rotary key is used by its heads only, so its gradient is summed over
    the ranks (``tp_group``, set by the harness)."""

    tp_group = None

    def __init__(self, size: ModelSize) -> None:
        super().__init__()
        m = size.mla
        assert m is not None, f"LatentAttention: {size.name} has no MLA spec"
        d, h = size.d_model, size.n_heads
        self.spec = m
        self._setup_positions(size)
        if m.q_rank:
            self.q_a = nn.Linear(d, m.q_rank, bias=False)
            self.q_a_norm = nn.RMSNorm(m.q_rank, eps=size.norm_eps)
            self.q_b = nn.Linear(m.q_rank, h * m.qk_dim, bias=False)
        else:
            self.q = nn.Linear(d, h * m.qk_dim, bias=False)
        self.kv_a = nn.Linear(d, m.kv_rank + m.rope_dim, bias=False)
        self.kv_a_norm = nn.RMSNorm(m.kv_rank, eps=size.norm_eps)
        self.kv_b = nn.Linear(m.kv_rank, h * (m.nope_dim + m.v_dim), bias=False)
        self.out = nn.Linear(h * m.v_dim, d, bias=False)

    def core(self, x: torch.Tensor) -> torch.Tensor:
        m = self.spec
        b, t, _ = x.shape
        q = self.q_b(self.q_a_norm(self.q_a(x))) if m.q_rank else self.q(x)
        q = q.view(b, t, -1, m.qk_dim).transpose(1, 2)  # (B, H_local, T, nope + rope)
        latent, k_rope = self.kv_a(x).split([m.kv_rank, m.rope_dim], dim=-1)
        kv = self.kv_b(self.kv_a_norm(latent)).view(b, t, -1, m.nope_dim + m.v_dim).transpose(1, 2)
        k_nope, v = kv.split([m.nope_dim, m.v_dim], dim=-1)  # (B, H_local, T, nope), (B, H_local, T, v)
        cos, sin = self._angles(t, x.device)
        q_nope, q_rope = q.split([m.nope_dim, m.rope_dim], dim=-1)
        q = torch.cat((q_nope, apply_rope(q_rope, cos, sin)), dim=-1)
        k_rope = sum_grad_over(k_rope, self.tp_group)  # every local head's part of its gradient, over tp
        k_rope = apply_rope(k_rope.unsqueeze(1), cos, sin).expand(-1, k_nope.shape[1], -1, -1)  # one shared head
        k = torch.cat((k_nope, k_rope), dim=-1)
        y = self.attend(q, k, v)  # (B, H_local, T, v)
        return y.transpose(1, 2).reshape(b, t, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.core(x))


class MLP(nn.Module):
    """gpt2's 4x GELU MLP (any width, with or without biases)."""

    def __init__(self, d_model: int, d_ff: int, bias: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, d_ff, bias=bias)
        self.proj = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


def _norm(size: ModelSize) -> nn.Module:
    if size.norm == "rmsnorm":
        return nn.RMSNorm(size.d_model, eps=size.norm_eps)
    return nn.LayerNorm(size.d_model, eps=size.norm_eps, bias=size.norm_bias)


class Block(nn.Module):
    def __init__(self, size: ModelSize, layer: int = 0) -> None:
        super().__init__()
        self.ln1 = _norm(size)
        self.attn: nn.Module = LatentAttention(size) if size.mla is not None else Attention(size)
        self.ln2 = _norm(size)
        if size.is_moe_layer(layer):
            assert size.moe is not None
            self.mlp: nn.Module = MoE(size.d_model, size.moe)
        elif size.mlp == "swiglu":
            self.mlp = SwiGLU(size.d_model, size.layer_ff(layer), bias=size.bias)
        else:
            self.mlp = MLP(size.d_model, size.layer_ff(layer), bias=size.bias)
        self.parallel_residual = size.parallel_residual
        self.norm_after = size.norm_after

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel_residual:  # GPT-NeoX: both sub-layers read the block's input
            return x + self.attn(self.ln1(x)) + self.mlp(self.ln2(x))
        if self.norm_after:  # OLMo 2: each sub-layer's output normalised inside the residual
            x = x + self.ln1(self.attn(x))
            return x + self.ln2(self.mlp(x))
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Decoder(nn.Module):
    """Decoder-only transformer of any architecture. ``forward(idx)`` returns logits ``(B, T, V)``."""

    def __init__(self, size: ModelSize) -> None:
        super().__init__()
        self.size = size
        pos = size.position_rows if size.learned_positions else None
        self.embed: Embeddings | None = Embeddings(size.vocab_size, pos, size.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(size, i) for i in range(size.n_layers)})
        self.norm: nn.Module | None = _norm(size)
        self.head: nn.Linear | None = nn.Linear(size.d_model, size.vocab_size, bias=False)
        self.reset_parameters()

    def block_items(self) -> list[tuple[str, nn.Module]]:
        """(name, block) of each block, in order: what FSDP, checkpointing and compile wrap one by one."""
        return list(self.blocks.items())

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 init for every architecture: N(0, 0.02), residual projections scaled by 1/sqrt(2L)."""
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
