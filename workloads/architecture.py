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
  (Press et al. 2022); or DeepSeek's multi-head latent attention (:class:`workloads.model_parts.MLASpec`);
* **MLP**: GELU (``fc``, ``proj``) or SwiGLU (``gate``, ``up``, ``proj``); or a mixture of experts (:class:`workloads.model_parts.MoESpec`),
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

from dataclasses import dataclass, replace

from workloads.model_parts import MLASpec, ModelOrigin, MoESpec

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
        """The record's ``workload`` (:func:`workloads.describe.workload_record`)."""
        from workloads.describe import workload_record  # noqa: PLC0415  (it reads this module's names)

        return workload_record(self)


def size_key(arch: str, name: str) -> str:
    """A size's name unique over families: ``tiny`` (gpt2, as records always had it), ``llama3-tiny``; a config model
    or a module its own name (which carries its digest)."""
    return name if arch in (DEFAULT_ARCH, CONFIG_ARCH, MODULE_ARCH) else f"{arch}-{name}"
