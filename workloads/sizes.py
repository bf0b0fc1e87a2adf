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

The block's parts, exact counts and FLOP conventions: :mod:`workloads.architecture`.
"""

from __future__ import annotations

from typing import Any

from workloads.architecture import (
    ARCHS,
    CONFIG_ARCH,
    DEFAULT_ARCH,
    FLOP_CONVENTION_LABEL,
    FLOP_CONVENTIONS,
    MODULE_ARCH,
    ModelSize,
    size_key,
)
from workloads.describe import seq_len_error
from workloads.model_parts import BALANCING, MoESpec

__all__ = ["ARCHS", "BALANCING", "CONFIG_ARCH", "DEFAULT_ARCH", "FAMILIES", "FLOP_CONVENTIONS", "FLOP_CONVENTION_LABEL",
           "MODULE_ARCH", "SIZES", "ModelSize", "MoESpec", "check_arch", "get_size", "seq_len_error", "size_key",
           "size_label"]

LLAMA_BLOCK: dict[str, Any] = dict(norm="rmsnorm", norm_bias=False, mlp="swiglu", bias=False, positions="rope")
"""The llama3 block's parts (:mod:`workloads.architecture`): RMSNorm, SwiGLU, no biases, RoPE."""

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
_LLAMA3 = tuple(ModelSize(name, arch="llama3", vocab_size=vocab, **LLAMA_BLOCK, **shape) for name, vocab, shape in _LLAMA3_SHAPES)

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
                                                         attn_head_dim=128, qk_norm="head", rope_theta=1e6,
                                                         norm_eps=1e-6, seq_len=4096, device_kind="plan")),
)
_MOE = tuple(ModelSize(name, arch="moe", vocab_size=vocab, moe=moe, **LLAMA_BLOCK, **shape) for name, vocab, moe, shape in _MOE_SHAPES)

FAMILIES: dict[str, dict[str, ModelSize]] = {"gpt2": {s.name: s for s in _GPT2}, "llama3": {s.name: s for s in _LLAMA3},
                                             "moe": {s.name: s for s in _MOE}}
SIZES: dict[str, ModelSize] = FAMILIES[DEFAULT_ARCH]
"""The default family's sizes (gpt2)."""


def size_label(config: dict) -> str | None:
    """A cell config's :func:`size_key` (records from before the arch axis are gpt2)."""
    size = config.get("size")
    return None if size is None else size_key(config.get("arch") or DEFAULT_ARCH, size)



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
