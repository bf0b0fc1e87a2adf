"""A config model at CPU scale: the same architecture, small enough for CPU ranks (docs/models.md, "Shrink rules").

``bench --model`` on CPU ranks runs the model shrunk unless ``--full-size`` is given; the record and the cell id say
so (the rules' version ends the size's name, ``-cpu2``, and is the record's ``model.shrink``). The rules keep what makes the architecture
what it is and shrink only its extent:

* every part of the block as it is: norms and where they sit, biases, positions (learned, rotary with its fraction,
  ALiBi), q/k norms, a parallel residual, MLA, the MLP's kind, the router's scoring, normalisation and scale;
* the grouped-query ratio ``n_heads / n_kv_heads`` (with at most 2 kv heads, so tp 2 divides them), at most 4 heads of
  multi-head attention (tp 4 divides them); MLA at 4 heads;
* the width ``d_model`` :data:`WIDTH` (where the heads do not divide it and each head is ``d_model / heads`` wide, the
  heads times the even width nearest ``WIDTH / heads``), and every other width in its ratio to ``d_model``, rounded to
  a multiple of 16
  (MLP and experts, q/k head width over ``d_model / n_heads``; MLA's ranks to a multiple of 8 and its head parts to 16,
  16 and 8, the rotary part the half of the no-position part it is in DeepSeek-V3);
* at most :data:`LAYERS` blocks, the dense-then-MoE pattern kept (one dense block where there were some);
* at most :data:`EXPERTS` experts (so ep 2 and 4 divide them), the top-k over the experts in its ratio (at least 2
  where it was at least 2), groups of routing in their ratio, the shared experts as they are;
* the vocabulary :data:`VOCAB`, the sequence :data:`SEQ_LEN` (a learned table that long).
"""

from __future__ import annotations

from dataclasses import replace

from workloads.architecture import ModelSize
from workloads.model_parts import MLASpec, MoESpec

VERSION = "cpu2"
"""The rules' version, kept in a record (``model.shrink``): a rule changed is a new version (``cpu1`` gave heads that
do not divide the width a fractional head width)."""
WIDTH = 128
LAYERS = 4
EXPERTS = 8
VOCAB = 256
SEQ_LEN = 128
MAX_MHA_HEADS = 4
MAX_KV_HEADS = 2


def _round(x: float, multiple: int = 16) -> int:
    return max(multiple, multiple * round(x / multiple))


def _heads(size: ModelSize) -> tuple[int, int]:
    """(query heads, kv heads) at CPU scale, the group ratio kept."""
    if size.mla is not None:
        return MAX_MHA_HEADS, MAX_MHA_HEADS
    if size.kv_heads == size.n_heads:
        h = min(size.n_heads, MAX_MHA_HEADS)
        return h, h
    kv = min(size.kv_heads, MAX_KV_HEADS)
    return kv * (size.n_heads // size.kv_heads), kv


def _head_dim(size: ModelSize, heads: int) -> int | None:
    """The q/k head width where it is not ``d / heads``: in its ratio to ``d_model / n_heads``, a multiple of 8."""
    if size.attn_head_dim is None:
        return None
    ratio = size.attn_head_dim / (size.d_model / size.n_heads)
    return _round(ratio * WIDTH / heads, 8)


def _moe(size: ModelSize) -> MoESpec | None:
    m = size.moe
    if m is None:
        return None
    e = min(m.n_experts, EXPERTS)
    k = min(e, max(2 if m.top_k >= 2 else 1, round(m.top_k * e / m.n_experts)))
    groups = min(m.n_group, max(1, e // 2))
    while e % groups:
        groups -= 1
    topk_group = max(1, min(groups, round(m.topk_group * groups / m.n_group)))
    while k > topk_group * e // groups:
        topk_group += 1
    return replace(m, n_experts=e, top_k=k, d_ff=_round(m.d_ff * WIDTH / size.d_model), n_group=groups,
                   topk_group=topk_group)


def _mla(size: ModelSize) -> MLASpec | None:
    m = size.mla
    if m is None:
        return None
    return MLASpec(q_rank=_round(m.q_rank * WIDTH / size.d_model, 8) if m.q_rank else 0,
                   kv_rank=_round(m.kv_rank * WIDTH / size.d_model, 8), nope_dim=16, rope_dim=8, v_dim=16)


def _width(size: ModelSize, heads: int) -> int:
    """:data:`WIDTH`, or where each head's width is ``d_model / heads`` and the heads do not divide it, the heads times
    the even width nearest ``WIDTH / heads`` (Qwen2.5-7B's 28 heads in groups of 7: 14 heads of 10, d 140)."""
    if size.attn_head_dim is not None or size.mla is not None or WIDTH % heads == 0:
        return WIDTH
    return heads * max(8, 2 * round(WIDTH / heads / 2))


def shrink(size: ModelSize) -> ModelSize:
    """``size`` by the rules above (a config model: its origin says which rules ran)."""
    assert size.origin is not None, f"shrink: {size.name} is a built-in size, which has its own CPU sizes"
    heads, kv = _heads(size)
    dense = min(size.dense_layers, 1)
    layers = min(size.n_layers, LAYERS)
    width = _width(size, heads)
    scale = width / size.d_model
    learned = size.learned_positions
    return replace(
        size, name=f"{size.name}-{VERSION}", n_layers=layers, d_model=width, n_heads=heads, n_kv_heads=kv,
        attn_head_dim=_head_dim(size, heads), ffn_width=_round(size.dense_ff * scale), vocab_size=VOCAB,
        seq_len=SEQ_LEN, max_positions=SEQ_LEN if learned else None, moe=_moe(size), mla=_mla(size),
        dense_layers=dense, dense_d_ff=_round(size.dense_d_ff * scale) if size.dense_d_ff else None,
        ffn_dim_multiplier=None, multiple_of=1, sliding_window=None, device_kind="cpu",
        origin=replace(size.origin, shrink=VERSION))
