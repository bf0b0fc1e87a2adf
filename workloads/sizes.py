"""Named model sizes of each architecture family, their exact parameter counts and FLOPs per token.

Three families (the ``--arch`` axis):

* ``gpt2``: pre-LayerNorm blocks with biases, learned positions, 4x GELU MLP, full multi-head
  attention (Radford et al. 2019; Brown et al. 2020, table 2.1).
* ``llama3``: pre-RMSNorm blocks without biases, rotary positions (RoPE, theta 500,000),
  SwiGLU MLP whose width Meta rounds (``ffn_dim_multiplier``, ``multiple_of``), grouped-query
  attention with ``n_kv_heads`` (Llama Team, "The Llama 3 Herd of Models", 2024, table 3; the
  ``params.json`` of each released checkpoint, reproduced in Meta's ``llama-models`` repository).
* ``moe``: the llama3 block with its MLP replaced by a mixture of experts (:class:`MoESpec`):
  a token-choice top-k router, E routed SwiGLU experts and optional shared ones. Its sizes count
  ``params`` (every parameter, what memory holds) and ``params_active`` (what one token
  computes with: attention, the router, k routed and the shared experts, the head): FLOPs per token
  use the active count, as MFU must (a total-parameter MFU overstates an MoE's by E / k on the experts).

FLOP conventions (per token, forward + backward, recompute not counted); ``N`` counts every
parameter except the embedding tables (lookups: no FLOPs), L layers, d model width, S sequence:

* ``palm`` (Chowdhery et al. 2022, appendix B): ``6 N + 12 L d S``, attention over the full
  S x S square.
* ``megatron`` (Narayanan et al. 2021) with causal masking: half the square is masked, so the
  attention term is halved: ``6 N + 6 L d S``. Megatron-Bridge counts Llama-3 this way.
* ``torchtitan`` (``get_dense_model_nparams_and_flops``): ``6 (P - E) + 12 L H q S`` with P all
  parameters, E the ``nn.Embedding`` ones, H heads of width q. For these families ``H q = d``,
  so it equals ``palm``; at Llama-3-8B's 8,192 tokens both sit 12% above ``megatron``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ARCHS = ("gpt2", "llama3", "moe")
DEFAULT_ARCH = "gpt2"
FLOP_CONVENTIONS = ("palm", "megatron", "torchtitan")
FLOP_CONVENTION_LABEL = {"palm": "PaLM 6N+12LdS (full attention square)",
                         "megatron": "Megatron 6N+6LdS (causal half)",
                         "torchtitan": "torchtitan 6(P-E)+12LHqS"}


BALANCING = ("bias", "aux")
"""How an MoE keeps its experts loaded: ``bias`` (DeepSeek-V3's auxiliary-loss-free per-expert bias,
added to the scores for the top-k choice only and nudged after each step towards the mean load) or
``aux`` (Switch Transformer's auxiliary loss ``coef E sum_e f_e P_e``, whose gradient joins the
model's; the reported loss is the language-model loss alone)."""


@dataclass(frozen=True)
class MoESpec:
    """The MoE layer of an ``moe`` size: replaces each block's SwiGLU MLP."""

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

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) must be in 1..n_experts ({self.n_experts})")
        if self.balancing not in BALANCING:
            raise ValueError(f"balancing {self.balancing!r}: choose from {', '.join(BALANCING)}")

    def expert_params(self, d_model: int) -> int:
        return 3 * d_model * self.d_ff

    def params(self, d_model: int) -> int:
        """Router, routed and shared experts of one layer."""
        return d_model * self.n_experts + (self.n_experts + self.n_shared) * self.expert_params(d_model)

    def active_params(self, d_model: int) -> int:
        """What one token computes with: the router's scores over every expert, k routed and the shared experts."""
        return d_model * self.n_experts + (self.top_k + self.n_shared) * self.expert_params(d_model)


@dataclass(frozen=True)
class ModelSize:
    """One reference workload: a pre-norm decoder of one family at one size."""

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int
    """The default sequence length (gpt2: also the learned position table's length)."""
    vocab_size: int
    device_kind: str
    """Where this size is meant to run: ``cpu`` sizes fit a 2-core CPU, ``gpu`` ones a GPU, ``plan``
    ones only ``harness plan`` and ``harness fit``."""
    arch: str = DEFAULT_ARCH
    n_kv_heads: int | None = None
    """Grouped-query attention's key/value heads (llama3); None: as many as query heads."""
    ffn_dim_multiplier: float | None = None
    multiple_of: int = 1
    """SwiGLU width rounding, as Meta's ``FeedForward`` rounds it."""
    rope_theta: float = 500_000.0
    norm_eps: float = 1e-5
    tied_published: bool = False
    """The published checkpoint ties the LM head to the token embedding (Llama 3.2 1B and 3B).
    The harness always trains an untied head, so tensor and pipeline parallel can place it freely."""
    attn_head_dim: int | None = None
    """Width of each attention head where it is not ``d_model / n_heads`` (Qwen3: 128 at d 2048 and
    32 heads, so q is 4,096 wide)."""
    qk_norm: bool = False
    """RMSNorm over each head's q and k before RoPE (Qwen3), one ``head_dim`` weight each per layer."""
    moe: MoESpec | None = None

    @property
    def key(self) -> str:
        """Unique over families: the size name for gpt2 (as records always had it), ``arch-name`` otherwise."""
        return size_key(self.arch, self.name)

    @property
    def llama(self) -> bool:
        """The llama3 block (RMSNorm, RoPE, GQA, SwiGLU, no biases): llama3's and moe's."""
        return self.arch in ("llama3", "moe")

    @property
    def learned_positions(self) -> bool:
        """gpt2's position table caps the sequence length; RoPE has no table."""
        return not self.llama

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.d_model // self.n_heads

    @property
    def q_dim(self) -> int:
        """Width of the q projection's output and the out projection's input: ``n_heads x head_dim``
        (``d_model`` but where ``attn_head_dim`` says otherwise)."""
        return self.n_heads * self.head_dim

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def kv_dim(self) -> int:
        """Width of the k and v projections' outputs."""
        return self.kv_heads * self.head_dim

    @property
    def d_ff(self) -> int:
        """MLP hidden width: 4 d (gpt2), Meta's SwiGLU rounding of 2/3 of 4 d (llama3), each expert's (moe)."""
        if self.moe is not None:
            return self.moe.d_ff
        if not self.llama:
            return 4 * self.d_model
        hidden = int(2 * 4 * self.d_model / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of the MLP: fc and proj (gpt2), gate, up and down (SwiGLU)."""
        return 3 if self.llama else 2

    @property
    def column_linears(self) -> int:
        """Linears of a block that read its normed input: q, k, v and the MLP's fc (or gate and up)."""
        return 3 + self.mlp_matrices - 1

    @property
    def params_embedding(self) -> int:
        """Token (and gpt2's position) embedding tables: lookups, no FLOPs."""
        pos = self.seq_len * self.d_model if self.learned_positions else 0
        return self.vocab_size * self.d_model + pos

    @property
    def qkv_params(self) -> int:
        """Weights (and biases) of the q, k and v projections of one layer."""
        d, kv = self.d_model, self.kv_dim
        return d * self.q_dim + 2 * d * kv + (0 if self.llama else d + 2 * kv)

    @property
    def norm_params_per_layer(self) -> int:
        """The two norms' weights (and LayerNorm biases), and q/k norms where the size has them: no matmul FLOPs."""
        return (2 * self.d_model + (2 * self.head_dim if self.qk_norm else 0)) if self.llama else 4 * self.d_model

    @property
    def mlp_params(self) -> int:
        """One layer's MLP, or its MoE layer (router and every expert)."""
        if self.moe is not None:
            return self.moe.params(self.d_model)
        return 3 * self.d_model * self.d_ff

    @property
    def params_per_layer(self) -> int:
        d, f = self.d_model, self.d_ff
        if self.llama:
            return self.qkv_params + self.q_dim * d + self.mlp_params + self.norm_params_per_layer
        attn = self.qkv_params + d * d + d  # out projection with bias
        mlp = d * f + f + f * d + d  # fc (d -> 4d) and proj (4d -> d) with bias
        return attn + mlp + self.norm_params_per_layer

    @property
    def final_norm_params(self) -> int:
        return self.d_model if self.llama else 2 * self.d_model

    @property
    def params_nonembedding(self) -> int:
        """N of the FLOP formulas: blocks, final norm and the (untied) LM head."""
        head = self.d_model * self.vocab_size  # no bias
        return self.n_layers * self.params_per_layer + self.final_norm_params + head

    @property
    def params(self) -> int:
        """Exact parameter count of the model the harness trains (:class:`workloads.model.Decoder`)."""
        return self.params_embedding + self.params_nonembedding

    @property
    def params_active_nonembedding(self) -> int:
        """N of the FLOP formulas: what one token computes with (an MoE's k routed experts, not all E)."""
        if self.moe is None:
            return self.params_nonembedding
        idle = (self.moe.n_experts - self.moe.top_k) * self.moe.expert_params(self.d_model)
        return self.params_nonembedding - self.n_layers * idle

    @property
    def params_active(self) -> int:
        """Parameters one token uses, embeddings included (as MoE model cards count "activated")."""
        return self.params_embedding + self.params_active_nonembedding

    @property
    def params_published(self) -> int:
        """The published checkpoint's count: without the LM head where it is tied to the embedding."""
        return self.params - (self.d_model * self.vocab_size if self.tied_published else 0)

    def _seq(self, seq_len: int | None) -> int:
        return self.seq_len if seq_len is None else seq_len

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """PaLM convention: ``6*N + 12*L*d*S`` (fwd + bwd, full attention square); N the active parameters
        and d the attention's width (``q_dim``)."""
        return 6 * self.params_active_nonembedding + 12 * self.n_layers * self.q_dim * self._seq(seq_len)

    def flops_per_token_total(self, seq_len: int | None = None) -> int:
        """``flops_per_token`` as if every parameter were active: what an MFU on total parameters
        wrongly assumes for an MoE (equal to it for dense sizes)."""
        return 6 * self.params_nonembedding + 12 * self.n_layers * self.q_dim * self._seq(seq_len)

    def flops_per_token_megatron(self, seq_len: int | None = None) -> int:
        """Megatron convention with the causal mask halving attention: ``6*N + 6*L*d*S``."""
        return 6 * self.params_active_nonembedding + 6 * self.n_layers * self.q_dim * self._seq(seq_len)

    def flops_per_token_torchtitan(self, seq_len: int | None = None) -> int:
        """torchtitan's count: ``6 * (params - nn.Embedding params) + 12 * L * H * head_dim * S``."""
        return (6 * self.params_active_nonembedding
                + 12 * self.n_layers * self.n_heads * self.head_dim * self._seq(seq_len))

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
            out.update(head_dim=self.head_dim, n_experts=m.n_experts, top_k=m.top_k, n_shared_experts=m.n_shared, balancing=m.balancing, params_active=self.params_active,
                       flops_per_token_total=self.flops_per_token_total())
        return out


# GPT-2 / GPT-3 shapes. The LM head is untied from the token embedding so that tensor and
# pipeline parallel can place it freely; that is why `small` counts ~163M parameters rather than
# GPT-2's 124M.
_VOCAB = 50304  # GPT-2's 50257 rounded up to a multiple of 128 (nanoGPT)
_GPT2 = (
    ModelSize("tiny", n_layers=4, d_model=128, n_heads=4, seq_len=128, vocab_size=256, device_kind="cpu"),
    ModelSize("mini", n_layers=6, d_model=256, n_heads=8, seq_len=256, vocab_size=1024, device_kind="cpu"),
    # tiny's block, 8 of them: a layer for each stage of a two-stage-per-rank schedule at 4 pipeline ranks
    ModelSize("deep", n_layers=8, d_model=128, n_heads=4, seq_len=128, vocab_size=256, device_kind="cpu"),
    ModelSize("small", n_layers=12, d_model=768, n_heads=12, seq_len=1024, vocab_size=_VOCAB, device_kind="gpu"),
    ModelSize("medium", n_layers=24, d_model=1024, n_heads=16, seq_len=1024, vocab_size=_VOCAB, device_kind="gpu"),
    ModelSize("large", n_layers=24, d_model=1536, n_heads=16, seq_len=1024, vocab_size=_VOCAB, device_kind="gpu"),
    ModelSize("xl", n_layers=24, d_model=2048, n_heads=16, seq_len=1024, vocab_size=_VOCAB, device_kind="gpu"),
)

# Llama 3.x: the shapes of Meta's released params.json (1B and 3B are Llama 3.2, 8B, 70B and 405B
# Llama 3.1; 128,256-token vocabulary). tiny and mini keep the block (GQA, RoPE, SwiGLU rounding)
# at CPU scale. Default sequence: Llama 3's 8,192-token pre-training context.
_LLAMA_VOCAB = 128_256
_LLAMA3_SHAPES: tuple[tuple[str, int, dict[str, Any]], ...] = (
    ("tiny", 256, dict(n_layers=4, d_model=128, n_heads=4, n_kv_heads=2, multiple_of=32, seq_len=128,
                       device_kind="cpu")),
    ("mini", 1024, dict(n_layers=6, d_model=256, n_heads=8, n_kv_heads=4, multiple_of=64, seq_len=256,
                        device_kind="cpu")),
    ("1b", _LLAMA_VOCAB, dict(n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5,
                              multiple_of=256, seq_len=8192, device_kind="gpu", tied_published=True)),
    ("3b", _LLAMA_VOCAB, dict(n_layers=28, d_model=3072, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0,
                              multiple_of=256, seq_len=8192, device_kind="gpu", tied_published=True)),
    ("8b", _LLAMA_VOCAB, dict(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3,
                              multiple_of=1024, seq_len=8192, device_kind="gpu")),
    ("70b", _LLAMA_VOCAB, dict(n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3,
                               multiple_of=4096, seq_len=8192, device_kind="plan")),
    ("405b", _LLAMA_VOCAB, dict(n_layers=126, d_model=16384, n_heads=128, n_kv_heads=8,
                                ffn_dim_multiplier=1.2, multiple_of=4096, seq_len=8192, device_kind="plan")),
)
_LLAMA3 = tuple(ModelSize(name, arch="llama3", vocab_size=vocab, **shape) for name, vocab, shape in _LLAMA3_SHAPES)

# Mixtures of experts on the llama3 block. tiny and mini run on a CPU (8 experts, top-2; mini adds a
# shared expert); mixtral-8x7b is Mistral's Mixtral-8x7B (46.7B total, 12.9B active; 32k-token
# vocabulary, RoPE theta 1e6); qwen3-30b-a3b is Qwen3-30B-A3B (30.5B total, 3.3B active: 128 experts
# of width 768, top-8, 128-wide heads at d 2,048, q/k norms). Both are for plan and fit, at the 4,096
# tokens of Megatron-Bridge's MoE rows.
_MOE_SHAPES: tuple[tuple[str, int, MoESpec, dict[str, Any]], ...] = (
    ("tiny", 256, MoESpec(8, 2, 128), dict(n_layers=4, d_model=128, n_heads=4, n_kv_heads=2, seq_len=128,
                                            device_kind="cpu")),
    ("mini", 1024, MoESpec(8, 2, 256, n_shared=1), dict(n_layers=6, d_model=256, n_heads=8, n_kv_heads=4,
                                                        seq_len=256, device_kind="cpu")),
    ("mixtral-8x7b", 32_000, MoESpec(8, 2, 14_336), dict(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8,
                                                       rope_theta=1e6, seq_len=4096, device_kind="plan")),
    ("qwen3-30b-a3b", 151_936, MoESpec(128, 8, 768), dict(n_layers=48, d_model=2048, n_heads=32, n_kv_heads=4,
                                                         attn_head_dim=128, qk_norm=True, rope_theta=1e6,
                                                         norm_eps=1e-6, seq_len=4096, device_kind="plan")),
)
_MOE = tuple(ModelSize(name, arch="moe", vocab_size=vocab, moe=moe, **shape) for name, vocab, moe, shape in _MOE_SHAPES)

FAMILIES: dict[str, dict[str, ModelSize]] = {"gpt2": {s.name: s for s in _GPT2}, "llama3": {s.name: s for s in _LLAMA3},
                                             "moe": {s.name: s for s in _MOE}}
SIZES: dict[str, ModelSize] = FAMILIES[DEFAULT_ARCH]
"""The default family's sizes (gpt2)."""


def size_key(arch: str, name: str) -> str:
    """A size's name unique over families: ``tiny`` (gpt2, as records always had it), ``llama3-tiny``."""
    return name if arch == DEFAULT_ARCH else f"{arch}-{name}"


def size_label(config: dict) -> str | None:
    """A cell config's :func:`size_key` (records from before the arch axis are gpt2)."""
    size = config.get("size")
    return None if size is None else size_key(config.get("arch") or DEFAULT_ARCH, size)


def seq_len_error(size: ModelSize, seq_len: int) -> str | None:
    """Why ``seq_len`` cannot run on ``size`` (None: it can). gpt2's learned position table caps the
    sequence; RoPE (llama3) has no table to cap it."""
    if size.learned_positions and seq_len > size.seq_len:
        return (f"seq_len ({seq_len}) exceeds {size.name}'s position table ({size.seq_len}); "
                         f"use --seq-len <= {size.seq_len}, or --arch llama3 (RoPE has no table)")
    return None


def check_arch(arch: str) -> str:
    if arch not in FAMILIES:
        raise ValueError(f"unknown architecture {arch!r}; choose from {', '.join(ARCHS)}")
    return arch


def get_size(name: str, arch: str | None = None) -> ModelSize:
    """Look a size up by name in ``arch``'s family (default gpt2), or by its key (``llama3-8b``);
    the error lists the valid names."""
    if arch is None and "-" in name and name.split("-", 1)[0] in FAMILIES:
        arch, name = name.split("-", 1)
    family = FAMILIES[check_arch(arch or DEFAULT_ARCH)]
    try:
        return family[name]
    except KeyError:
        raise ValueError(f"unknown {arch or DEFAULT_ARCH} size {name!r}; choose from {', '.join(family)}") from None
