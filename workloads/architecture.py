"""What a decoder is, as a value: its block's parts and shapes (:class:`ModelSize`), and its exact counts.

A model is one embedding, ``n_layers`` blocks and an LM head. Every block has two norms, an attention and an
MLP, arranged as the architecture says; the fields below name each choice, so one module tree
(:class:`workloads.model.Decoder`) and one analytic model (``harness.model``) serve every architecture:

* **norms** (``norm``): LayerNorm (with or without bias) or RMSNorm; placed before each sub-layer (pre-norm, GPT-2,
  Llama) or on each sub-layer's output inside the residual (``norm_after``, OLMo 2);
* **residual** (``parallel_residual``): ``x + attn(ln1(x)) + mlp(ln2(x))`` (GPT-NeoX, GPT-J) instead of two steps;
* **attention**: multi-head or grouped-query (``n_kv_heads``) with an optional head width (``attn_head_dim``), biases
  (``bias`` everywhere, or ``qkv_bias`` on q, k and v only: Qwen2), q/k norms per head (Qwen3) or over the whole
  projection (OLMo 2), positions by a learned table, RoPE on all or part of each head (``rotary_fraction``) or ALiBi
  (Press et al. 2022); or DeepSeek's multi-head latent attention (:class:`MLASpec`);
* **MLP**: GELU (``fc``, ``proj``) or SwiGLU (``gate``, ``up``, ``proj``); or a mixture of experts (:class:`MoESpec`),
  after ``dense_layers`` dense blocks (DeepSeek-V3's ``first_k_dense_replace``).

Counts are exact for the module tree the harness builds, whose LM head is always untied (tensor and pipeline parallel
place it freely); ``params_published`` is the released checkpoint's count, without the head where it is tied. A
config model's counts are held to ``transformers``' own model built on the meta device (tests/unit/test_hf_counts.py).

FLOP conventions (per token, forward + backward, recompute not counted); ``N`` counts every parameter a token
computes with except the embedding tables (lookups), L layers, S the sequence, and the attention's widths
``A = H x (q/k head width + v head width)`` (``2 d`` for the classic block):

* ``palm`` (Chowdhery et al. 2022, appendix B): ``6 N + 6 L A S``, the full S x S square (``6 N + 12 L d S``);
* ``megatron`` (Narayanan et al. 2021), causal: half the square, ``6 N + 3 L A S``;
* ``torchtitan`` (``get_dense_model_nparams_and_flops``): ``6 (P - E) + 12 L H q S``, q the head width (the mean of
  the q/k and v widths under MLA), so equal to ``palm``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

ARCHS = ("gpt2", "llama3", "moe")
"""The built-in families (``--arch``)."""
DEFAULT_ARCH = "gpt2"
CONFIG_ARCH = "config"
"""The ``arch`` of a model read from a ``config.json`` (``--model``): its name and content say which."""
MODULE_ARCH = "module"
"""The ``arch`` of a user's own ``nn.Module`` (``--model module:factory``)."""
FLOP_CONVENTIONS = ("palm", "megatron", "torchtitan")
FLOP_CONVENTION_LABEL = {"palm": "PaLM 6N+12LdS (full attention square)",
                         "megatron": "Megatron 6N+6LdS (causal half)",
                         "torchtitan": "torchtitan 6(P-E)+12LHqS"}
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")
POSITIONS = ("learned", "rope", "alibi")
QK_NORMS = ("head", "proj")
"""q/k norms over each head's width (Qwen3) or over the whole projection (OLMo 2)."""
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


@dataclass(frozen=True)
class ModelSize:
    """One workload: a pre-norm (or post-norm) decoder, at one size."""

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int
    """The default sequence length (the learned position table's length where ``max_positions`` is unset)."""
    vocab_size: int
    device_kind: str
    """Where this size is meant to run: ``cpu`` sizes fit a 2-core CPU, ``gpu`` ones a GPU, ``plan``
    ones only ``harness plan`` and ``harness fit``."""
    arch: str = DEFAULT_ARCH
    n_kv_heads: int | None = None
    """Grouped-query attention's key/value heads; None: as many as query heads."""
    ffn_dim_multiplier: float | None = None
    multiple_of: int = 1
    """SwiGLU width rounding, as Meta's ``FeedForward`` rounds it (when ``ffn_width`` is unset)."""
    ffn_width: int | None = None
    """The dense MLP's hidden width as given (a config's ``intermediate_size``); None: the family's rule."""
    rope_theta: float = 500_000.0
    norm_eps: float = 1e-5
    tied_published: bool = False
    """The published checkpoint ties the LM head to the token embedding (Llama 3.2 1B and 3B). The harness always
    trains an untied head, so tensor and pipeline parallel can place it freely."""
    attn_head_dim: int | None = None
    """Width of each attention head where it is not ``d_model / n_heads`` (Qwen3: 128 at d 2048 and 32 heads)."""
    qk_norm: str | None = None
    """RMSNorm over q and k before RoPE: ``head`` (each head's width: Qwen3) or ``proj`` (the whole projection:
    OLMo 2); None: none."""
    moe: MoESpec | None = None
    dense_layers: int = 0
    """An MoE's first blocks with a dense MLP (DeepSeek-V3's ``first_k_dense_replace``)."""
    dense_d_ff: int | None = None
    """Their MLP width (DeepSeek-V3's ``intermediate_size``)."""
    norm: str = "layernorm"
    norm_bias: bool = True
    mlp: str = "gelu"
    bias: bool = True
    """Every linear of the attention and the MLP has a bias (GPT-2, GPT-NeoX)."""
    qkv_bias: bool = False
    """Only q, k and v have biases (Qwen2)."""
    positions: str = "learned"
    rotary_fraction: float = 1.0
    """The share of each head's width RoPE rotates (GPT-NeoX's ``rotary_pct``)."""
    max_positions: int | None = None
    """The learned position table's rows; None: ``seq_len``."""
    parallel_residual: bool = False
    norm_after: bool = False
    """The norms on each sub-layer's output, inside the residual: ``x + ln1(attn(x))`` (OLMo 2)."""
    mla: MLASpec | None = None
    sliding_window: int | None = None
    """Attention over the last this many tokens only (Mistral 7B v0.1): not built; a longer sequence is refused."""
    origin: ModelOrigin | None = None
    """None for a built-in size; a config's or a factory's source otherwise."""

    def __post_init__(self) -> None:
        for value, valid, what in ((self.norm, NORMS, "norm"), (self.mlp, MLPS, "mlp"),
                                   (self.positions, POSITIONS, "positions")):
            if value not in valid:
                raise ValueError(f"{what} {value!r}: choose from {', '.join(valid)}")
        if self.qk_norm is not None and self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm {self.qk_norm!r}: choose from {', '.join(QK_NORMS)} or None")
        if not 0 <= self.dense_layers <= self.n_layers:
            raise ValueError(f"dense_layers ({self.dense_layers}) must be in 0..n_layers ({self.n_layers})")

    @property
    def key(self) -> str:
        """Unique over families: the size name for gpt2 (as records always had it), ``arch-name`` otherwise; a
        config model's or module's own name (which carries its digest)."""
        return size_key(self.arch, self.name)

    @property
    def llama(self) -> bool:
        """The llama3 block (RMSNorm, RoPE, SwiGLU, no biases)."""
        return self.norm == "rmsnorm" and self.mlp == "swiglu" and self.positions == "rope" and not self.bias

    @property
    def learned_positions(self) -> bool:
        """A learned position table caps the sequence length; RoPE and ALiBi have no table."""
        return self.positions == "learned"

    @property
    def position_rows(self) -> int:
        return self.max_positions or self.seq_len

    @property
    def head_dim(self) -> int:
        """Each head's q and k width (MLA: the no-position and rotary parts together)."""
        if self.mla is not None:
            return self.mla.qk_dim
        return self.attn_head_dim or self.d_model // self.n_heads

    @property
    def v_head_dim(self) -> int:
        return self.mla.v_dim if self.mla is not None else self.head_dim

    @property
    def rotary_dim(self) -> int:
        """The width of each head RoPE rotates (even): all of it, a fraction (GPT-NeoX), MLA's rope part, or 0."""
        if self.positions != "rope":
            return 0
        if self.mla is not None:
            return self.mla.rope_dim
        return int(self.head_dim * self.rotary_fraction) // 2 * 2

    @property
    def q_dim(self) -> int:
        """Width of the q projection's output: ``n_heads x head_dim``."""
        return self.n_heads * self.head_dim

    @property
    def v_dim(self) -> int:
        """Width of the attention's output, the out projection's input: ``n_heads x v_head_dim``."""
        return self.n_heads * self.v_head_dim

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.mla is not None else (self.n_kv_heads or self.n_heads)

    @property
    def kv_dim(self) -> int:
        """Width of the k (and v) projections' outputs."""
        return self.kv_heads * self.head_dim

    @property
    def dense_ff(self) -> int:
        """A dense block's MLP width: as given, 4 d (gpt2), Meta's SwiGLU rounding of 2/3 of 4 d (llama3)."""
        if self.ffn_width is not None:
            return self.ffn_width
        if self.mlp == "gelu":
            return 4 * self.d_model
        hidden = int(2 * 4 * self.d_model / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @property
    def d_ff(self) -> int:
        """MLP hidden width: each expert's for an MoE, else :attr:`dense_ff`."""
        return self.moe.d_ff if self.moe is not None else self.dense_ff

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer >= self.dense_layers

    def at_layer(self, layer: int) -> ModelSize:
        """Block ``layer``'s shape as a model of such blocks: itself, or for an MoE model's dense first blocks the
        same model with their dense MLP (what a per-block formula of the analytic model reads)."""
        if self.moe is None or self.is_moe_layer(layer):
            return self
        return replace(self, moe=None, ffn_width=self.layer_ff(layer), dense_layers=0, dense_d_ff=None)

    @property
    def moe_layers(self) -> int:
        """Blocks with a mixture of experts."""
        return 0 if self.moe is None else self.n_layers - self.dense_layers

    def layer_ff(self, layer: int) -> int:
        """Block ``layer``'s dense MLP width (an MoE model's first dense blocks: ``dense_d_ff``)."""
        if self.moe is not None and not self.is_moe_layer(layer):
            return self.dense_d_ff or self.dense_ff
        return self.dense_ff

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of a dense MLP: fc and proj (GELU), gate, up and down (SwiGLU)."""
        return 3 if self.mlp == "swiglu" else 2

    @property
    def column_linears(self) -> int:
        """Linears of a block that read its normed input: q, k, v and the MLP's fc (or gate and up)."""
        return 3 + self.mlp_matrices - 1

    @property
    def params_embedding(self) -> int:
        """Token (and a learned position) embedding tables: lookups, no FLOPs."""
        pos = self.position_rows * self.d_model if self.learned_positions else 0
        return self.vocab_size * self.d_model + pos

    @property
    def norm_weights(self) -> int:
        """One block norm's (or the final norm's) parameters: weight, and LayerNorm's bias where it has one."""
        return self.d_model * (2 if self.norm == "layernorm" and self.norm_bias else 1)

    @property
    def qkv_params(self) -> int:
        """Weights (and biases) of the q, k and v projections of one layer (MLA: every projection but the output)."""
        if self.mla is not None:
            return self.mla.params(self.d_model, self.n_heads) - self.v_dim * self.d_model - self.mla.norm_params()
        d, kv = self.d_model, self.kv_dim
        biased = self.bias or self.qkv_bias
        return d * self.q_dim + 2 * d * kv + (self.q_dim + 2 * kv if biased else 0)

    @property
    def attn_norm_params(self) -> int:
        """The attention's own norm weights (q/k norms, MLA's latent norms): no matmul FLOPs."""
        if self.mla is not None:
            return self.mla.norm_params()
        if self.qk_norm == "head":
            return 2 * self.head_dim
        if self.qk_norm == "proj":
            return self.q_dim + self.kv_dim
        return 0

    @property
    def attn_params(self) -> int:
        """One layer's attention: q, k, v, the output projection (its bias where linears have one), its norms."""
        return self.qkv_params + self.v_dim * self.d_model + (self.d_model if self.bias else 0) + self.attn_norm_params

    def dense_mlp_params(self, width: int) -> int:
        d = self.d_model
        return self.mlp_matrices * d * width + ((self.mlp_matrices - 1) * width + d if self.bias else 0)

    def mlp_params_of(self, layer: int) -> int:
        """Block ``layer``'s MLP, or its MoE layer (router and every expert)."""
        if self.is_moe_layer(layer):
            assert self.moe is not None
            return self.moe.params(self.d_model)
        return self.dense_mlp_params(self.layer_ff(layer))

    @property
    def mlp_params(self) -> int:
        """The last block's MLP (every block's but an MoE model's first dense ones)."""
        return self.mlp_params_of(self.n_layers - 1)

    @property
    def norm_params_per_layer(self) -> int:
        """The two norms' weights (and biases) and the attention's own norms: no matmul FLOPs."""
        return 2 * self.norm_weights + self.attn_norm_params

    def layer_params(self, layer: int) -> int:
        return self.attn_params + self.mlp_params_of(layer) + 2 * self.norm_weights

    @property
    def params_per_layer(self) -> int:
        """The last block's parameters (every block's but an MoE model's first dense ones)."""
        return self.layer_params(self.n_layers - 1)

    def idle_params_of(self, layer: int) -> int:
        """Block ``layer``'s parameters one token does not compute with: an MoE layer's E - k routed experts."""
        if not self.is_moe_layer(layer):
            return 0
        assert self.moe is not None
        return (self.moe.n_experts - self.moe.top_k) * self.moe.expert_params(self.d_model)

    def layer_matmul_params(self, layer: int) -> int:
        """The weights a token multiplies in block ``layer`` (norms do no matmul; idle experts none)."""
        return self.layer_params(layer) - self.norm_params_per_layer - self.idle_params_of(layer)

    @property
    def final_norm_params(self) -> int:
        return self.norm_weights

    @property
    def params_nonembedding(self) -> int:
        """N of the FLOP formulas: blocks, final norm and the (untied) LM head."""
        head = self.d_model * self.vocab_size  # no bias
        return sum(self.layer_params(i) for i in range(self.n_layers)) + self.final_norm_params + head

    @property
    def params(self) -> int:
        """Exact parameter count of the model the harness trains (:class:`workloads.model.Decoder`)."""
        return self.params_embedding + self.params_nonembedding

    @property
    def params_active_nonembedding(self) -> int:
        """N of the FLOP formulas: what one token computes with (an MoE's k routed experts, not all E)."""
        return self.params_nonembedding - sum(self.idle_params_of(i) for i in range(self.n_layers))

    @property
    def params_active(self) -> int:
        """Parameters one token uses, embeddings included (as MoE model cards count "activated")."""
        return self.params_embedding + self.params_active_nonembedding

    @property
    def params_published(self) -> int:
        """The published checkpoint's count: without the LM head where it is tied to the embedding."""
        return self.params - (self.d_model * self.vocab_size if self.tied_published else 0)

    @property
    def params_active_published(self) -> int:
        return self.params_active - (self.d_model * self.vocab_size if self.tied_published else 0)

    def _seq(self, seq_len: int | None) -> int:
        return self.seq_len if seq_len is None else seq_len

    @property
    def attention_width(self) -> int:
        """``A``: the widths the scores and the values multiply, ``H x (q/k head + v head)`` (``2 q_dim``)."""
        return self.q_dim + self.v_dim

    def attention_flops_per_token(self, seq_len: int | None = None) -> int:
        """The attention square's forward + backward FLOPs per token, all layers (PaLM's full square)."""
        return 6 * self.n_layers * self.attention_width * self._seq(seq_len)

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """PaLM convention: ``6*N + 6*L*A*S`` (``6 N + 12 L d S``; fwd + bwd, full attention square); N the active
        parameters."""
        return 6 * self.params_active_nonembedding + self.attention_flops_per_token(seq_len)

    def flops_per_token_total(self, seq_len: int | None = None) -> int:
        """``flops_per_token`` as if every parameter were active: what an MFU on total parameters
        wrongly assumes for an MoE (equal to it for dense sizes)."""
        return 6 * self.params_nonembedding + self.attention_flops_per_token(seq_len)

    def flops_per_token_megatron(self, seq_len: int | None = None) -> int:
        """Megatron convention with the causal mask halving attention: ``6*N + 3*L*A*S``."""
        return 6 * self.params_active_nonembedding + self.attention_flops_per_token(seq_len) // 2

    def flops_per_token_torchtitan(self, seq_len: int | None = None) -> int:
        """torchtitan's count: ``6 * (params - nn.Embedding params) + 12 * L * H * head_dim * S`` (head_dim the mean
        of the q/k and v head widths where they differ)."""
        return 6 * self.params_active_nonembedding + self.attention_flops_per_token(seq_len)

    def flops_by_convention(self, seq_len: int | None = None) -> dict[str, int]:
        return {"palm": self.flops_per_token(seq_len), "megatron": self.flops_per_token_megatron(seq_len),
                "torchtitan": self.flops_per_token_torchtitan(seq_len)}

    def as_dict(self) -> dict:
        out = {
            "name": self.name,
            "n_layers": self.n_layers,
            "d_model": self.d_model,
            "n_heads": self.n_heads,
            "seq_len": self.seq_len,
            "vocab_size": self.vocab_size,
            "params": self.params,
            "params_nonembedding": self.params_nonembedding,
            "flops_per_token": self.flops_per_token(),
            "flops_per_token_megatron": self.flops_per_token_megatron(),
        }
        if self.arch != DEFAULT_ARCH:  # gpt2 records keep the workload they always had
            out.update(arch=self.arch, n_kv_heads=self.kv_heads, d_ff=self.d_ff, rope_theta=self.rope_theta,
                       params_published=self.params_published,
                       flops_per_token_torchtitan=self.flops_per_token_torchtitan())
        if self.moe is not None:
            m = self.moe
            out.update(head_dim=self.head_dim, n_experts=m.n_experts, top_k=m.top_k, n_shared_experts=m.n_shared,
                       balancing=m.balancing, params_active=self.params_active,
                       flops_per_token_total=self.flops_per_token_total())
        if self.origin is not None:
            out.update(block=self.block_summary(), model=self.origin.as_dict())
        return out

    def block_summary(self) -> str:
        """The block in one line: what a config model mapped onto (records, ``harness workloads``)."""
        attn = (f"MLA (q rank {self.mla.q_rank}, kv rank {self.mla.kv_rank}, heads {self.n_heads} x "
                f"{self.mla.nope_dim}+{self.mla.rope_dim}/{self.mla.v_dim})" if self.mla is not None
                else f"{'MHA' if self.kv_heads == self.n_heads else 'GQA'} {self.n_heads}/{self.kv_heads} x "
                     f"{self.head_dim}")
        pos = {"learned": f"learned positions ({self.position_rows})", "alibi": "ALiBi",
               "rope": f"RoPE theta {self.rope_theta:g}" + (f" on {self.rotary_dim} of {self.head_dim}"
                                                            if self.rotary_dim != self.head_dim else "")}[self.positions]
        parts = [f"{self.norm}{'' if self.norm_bias or self.norm == 'rmsnorm' else ' (no bias)'}"
                 + (" after" if self.norm_after else ""), attn, pos]
        if self.qk_norm:
            parts.append(f"q/k norm per {'head' if self.qk_norm == 'head' else 'projection'}")
        parts.append("biases" if self.bias else "qkv biases" if self.qkv_bias else "no biases")
        if self.parallel_residual:
            parts.append("parallel residual")
        if self.moe is not None:
            m = self.moe
            route = f"{m.score} top-{m.top_k} of {m.n_experts}" + (
                f" in {m.topk_group} of {m.n_group} groups" if m.n_group > 1 else "")
            parts.append(f"MoE {route}, expert d_ff {m.d_ff}" + (f", {m.n_shared} shared" if m.n_shared else "")
                         + (f", first {self.dense_layers} dense (d_ff {self.layer_ff(0)})" if self.dense_layers else ""))
        else:
            parts.append(f"{self.mlp} d_ff {self.dense_ff}")
        return "; ".join(parts)


def size_key(arch: str, name: str) -> str:
    """A size's name unique over families: ``tiny`` (gpt2, as records always had it), ``llama3-tiny``; a config model
    or a module its own name (which carries its digest)."""
    return name if arch in (DEFAULT_ARCH, CONFIG_ARCH, MODULE_ARCH) else f"{arch}-{name}"


def seq_len_error(size: ModelSize, seq_len: int) -> str | None:
    """Why ``seq_len`` cannot run on ``size`` (None: it can). A learned position table caps the sequence; RoPE and
    ALiBi have no table to cap it."""
    if size.learned_positions and seq_len > size.position_rows:
        return (f"seq_len ({seq_len}) exceeds {size.name}'s position table ({size.position_rows}); "
                f"use --seq-len <= {size.position_rows}, or --arch llama3 (RoPE has no table)")
    if size.sliding_window is not None and seq_len > size.sliding_window:
        return (f"seq_len ({seq_len}) exceeds {size.name}'s sliding_window ({size.sliding_window}), which the harness "
                f"does not build (it attends the whole causal window); use --seq-len <= {size.sliding_window}")
    return None
