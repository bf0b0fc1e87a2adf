"""The parts of a decoder that are values of their own: a mixture of experts and its routing (:class:`MoESpec`),
DeepSeek's multi-head latent attention (:class:`MLASpec`), and where a model that is not a built-in size came from
(:class:`ModelOrigin`). :class:`workloads.architecture.ModelSize` holds them."""

from __future__ import annotations

import json
from dataclasses import dataclass

SCORES = ("softmax", "sigmoid")


BALANCING = ("bias", "aux")
"""How an MoE keeps its experts loaded: ``bias`` (DeepSeek-V3's auxiliary-loss-free per-expert bias,
added to the scores for the top-k choice only and nudged after each step towards the mean load) or
``aux`` (Switch Transformer's auxiliary loss ``coef E sum_e f_e P_e``, whose gradient joins the
model's; the reported loss is the language-model loss alone)."""


@dataclass(frozen=True)
class MoESpec:
    """The MoE layer of an MoE block: replaces its MLP."""

    n_experts: int
    top_k: int
    d_ff: int
    """Hidden width of each routed expert (a SwiGLU: gate, up and down)."""
    n_shared: int = 0
    """Shared experts, always active, one SwiGLU ``n_shared x d_ff`` wide (DeepSeek's layout)."""
    balancing: str = "bias"
    aux_coef: float = 0.01
    bias_rate: float = 1e-3
    """The expert bias's step per update (DeepSeek-V3's gamma)."""
    score: str = "softmax"
    """The router's scores: a softmax over the experts (Mixtral, Qwen3) or each expert's sigmoid (DeepSeek-V3)."""
    norm_topk: bool = True
    """Weights renormalised over the k chosen (Mixtral; Qwen3-MoE's and DeepSeek's ``norm_topk_prob``)."""
    n_group: int = 1
    topk_group: int = 1
    """Group-limited routing (DeepSeek-V3): the experts in ``n_group`` groups, a token chooses among the
    ``topk_group`` groups whose two best scores sum highest."""
    routed_scale: float = 1.0
    """The routed experts' output scaled by this (DeepSeek-V3's ``routed_scaling_factor``)."""

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) must be in 1..n_experts ({self.n_experts})")
        if self.balancing not in BALANCING:
            raise ValueError(f"balancing {self.balancing!r}: choose from {', '.join(BALANCING)}")
        if self.score not in SCORES:
            raise ValueError(f"score {self.score!r}: choose from {', '.join(SCORES)}")
        if self.n_group < 1 or self.n_experts % self.n_group:
            raise ValueError(f"n_group ({self.n_group}) must divide n_experts ({self.n_experts})")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must be in 1..n_group ({self.n_group})")
        if self.top_k > self.topk_group * self.n_experts // self.n_group:
            raise ValueError(f"top_k ({self.top_k}) exceeds the experts of the topk_group ({self.topk_group}) groups "
                             f"of {self.n_experts // self.n_group}")

    def expert_params(self, d_model: int) -> int:
        return 3 * d_model * self.d_ff

    def params(self, d_model: int) -> int:
        """Router, routed and shared experts of one layer."""
        return d_model * self.n_experts + (self.n_experts + self.n_shared) * self.expert_params(d_model)

    def active_params(self, d_model: int) -> int:
        """What one token computes with: the router's scores over every expert, k routed and the shared experts."""
        return d_model * self.n_experts + (self.top_k + self.n_shared) * self.expert_params(d_model)


@dataclass(frozen=True)
class MLASpec:
    """DeepSeek-V2/V3's multi-head latent attention (DeepSeek-AI 2024, section 2.1.2): q through a low-rank
    ``q_rank`` bottleneck (or projected directly when 0), k and v from one ``kv_rank`` latent; each head's q and k
    are a ``nope_dim`` part without positions and a ``rope_dim`` part rotated by RoPE, whose k is one shared head."""

    q_rank: int
    kv_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int

    @property
    def qk_dim(self) -> int:
        return self.nope_dim + self.rope_dim

    def params(self, d: int, heads: int) -> int:
        """q (a, its norm, b; or one projection), kv_a, its norm, kv_b and the output projection."""
        q = d * self.q_rank + self.q_rank + self.q_rank * heads * self.qk_dim if self.q_rank else d * heads * self.qk_dim
        kv = d * (self.kv_rank + self.rope_dim) + self.kv_rank + self.kv_rank * heads * (self.nope_dim + self.v_dim)
        return q + kv + heads * self.v_dim * d

    def norm_params(self) -> int:
        """The two latent norms' weights: no matmul FLOPs."""
        return self.kv_rank + self.q_rank


@dataclass(frozen=True)
class ModelOrigin:
    """Where a model that is not a built-in size came from, with what rebuilds it (a record keeps it)."""

    kind: str
    """``config`` (a ``config.json``) or ``module`` (a factory)."""
    name: str
    """The file's stem (the folder's name for a ``config.json`` in a folder), or the factory's ``module:function``."""
    digest: str
    """sha256 of the content, 12 hex characters: two files of one name never share an id."""
    content: str
    """The config's JSON, canonical (sorted keys), or the factory's spec."""
    shrink: str | None = None
    """The shrink rules it runs under (:mod:`workloads.shrink`), None at full size."""
    notes: tuple[str, ...] = ()
    """What the mapping says of fields it models differently or leaves out (each a line shown once)."""

    def as_dict(self) -> dict:
        return {"kind": self.kind, "name": self.name, "digest": self.digest, "shrink": self.shrink,
                "notes": list(self.notes), "content": json.loads(self.content)}
