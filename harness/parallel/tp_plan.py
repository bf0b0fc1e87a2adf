"""Which of a block's parameters tensor parallel splits, by name: the plan :mod:`harness.parallel.tp` applies and
the model (:mod:`harness.model.inventory`, :mod:`harness.model.comm`) prices, in a module of names only, so the
planner and the CLI never import DTensor to read it."""

from __future__ import annotations

COLUMN_LINEARS = ("attn.q", "attn.k", "attn.v", "attn.q_b", "attn.kv_b", "mlp.fc", "mlp.gate", "mlp.up",
                  "mlp.shared.gate", "mlp.shared.up")
"""Column-parallel linears of a block (gpt2's MLP has ``fc``, llama3's SwiGLU ``gate`` and ``up``, an MoE's
shared expert ``shared.gate`` and ``shared.up``): each rank holds ``n_heads / tp`` query heads,
``n_kv_heads / tp`` key/value heads (grouped-query attention keeps each rank's query heads with the
key/value heads they share) and ``d_ff / tp`` MLP columns. An MoE's routed experts are split by
expert parallel (:mod:`harness.parallel.ep`), its router replicated. Under multi-head latent attention the
up-projections ``q_b`` (or ``q``) and ``kv_b`` split the heads; the low-rank down-projections ``q_a`` and ``kv_a``
and their norms stay whole on every rank (torchtitan places DeepSeek-V3's alike)."""
ROW_LINEARS = ("attn.out", "mlp.proj", "mlp.shared.proj")
PROJ_NORMS = ("attn.q_norm", "attn.k_norm")
"""q/k norms over a whole projection (OLMo 2's, :class:`workloads.layers.ProjNorm`): sharded with the projection's
columns, their squares summed over tp in the forward (an all-reduce each, and one each in the backward)."""


HEAD_SHARED = ("attn.q_norm.weight", "attn.k_norm.weight")
"""Per-head q/k norm weights (Qwen3's): one weight every head uses, so a tp rank's gradient holds its own heads' part
only; :func:`reduce_head_shared_grads` sums it over tp."""
