"""The matmuls of one transformer block, in the order its forward runs them: what the ``op`` checkpointing
policy keeps or recomputes (:class:`harness.parallel.activation_checkpoint.EveryOtherMatmul` keeps the 1st,
3rd, 5th, ...), so memory and compute price the same list."""

from __future__ import annotations

from dataclasses import dataclass

from workloads.sizes import ModelSize


@dataclass(frozen=True)
class Matmul:
    name: str
    k: int
    """Input width (the weight's columns)."""
    n: int
    """Output width of the whole layer (the weight's rows)."""
    rows: float
    """Rows per local token: 1, or an expert's share of the routed rows."""
    split: str
    """Under tensor parallel: ``column`` (output sharded), ``row`` (input sharded, output whole and summed
    over tp) or ``replicated`` (the router)."""

    def output_bytes(self, tp: int, dtype_bytes: int) -> float:
        """Bytes of its output per local token on one tp rank."""
        return self.rows * (self.n / tp if self.split == "column" else self.n) * dtype_bytes

    def flops(self, tp: int) -> float:
        """Forward FLOPs per local token on one tp rank (2 per multiply-add)."""
        return 2 * self.rows * self.k * self.n / (1 if self.split == "replicated" else tp)


def block_matmuls(size: ModelSize, ep: int = 1) -> list[Matmul]:
    """q, k, v and the attention's output projection (MLA: q_a and q_b, or q; kv_a, kv_b and out, the low-rank
    down-projections whole on every tp rank); the MLP's column linears (gpt2's fc, SwiGLU's gate and up) and its
    output; an MoE's router, then each of this rank's ``E / ep`` experts' gate, up and output over its balanced
    share of the routed rows (``k ep / E`` per token), then the shared expert's three. A block of ``size`` as its
    blocks are (an MoE model's dense first blocks: :meth:`workloads.architecture.ModelSize.at_layer`)."""
    return _attention_matmuls(size) + _mlp_matmuls(size, ep)


def _attention_matmuls(size: ModelSize) -> list[Matmul]:
    d, m = size.d_model, size.mla
    if m is None:
        return [Matmul("q", d, size.q_dim, 1, "column"), Matmul("k", d, size.kv_dim, 1, "column"),
                Matmul("v", d, size.kv_dim, 1, "column"), Matmul("out", size.v_dim, d, 1, "row")]
    q = [Matmul("q_a", d, m.q_rank, 1, "replicated"), Matmul("q_b", m.q_rank, size.q_dim, 1, "column")] if m.q_rank \
        else [Matmul("q", d, size.q_dim, 1, "column")]
    return q + [Matmul("kv_a", d, m.kv_rank + m.rope_dim, 1, "replicated"),
                Matmul("kv_b", m.kv_rank, size.n_heads * (m.nope_dim + m.v_dim), 1, "column"),
                Matmul("out", size.v_dim, d, 1, "row")]


def _mlp_matmuls(size: ModelSize, ep: int) -> list[Matmul]:
    d = size.d_model
    if size.moe is None:
        names = ("gate", "up") if size.mlp == "swiglu" else ("fc",)
        return [Matmul(n, d, size.d_ff, 1, "column") for n in names] + [Matmul("proj", size.d_ff, d, 1, "row")]
    m = size.moe
    out = [Matmul("router", d, m.n_experts, 1, "replicated")]
    rows = m.top_k * ep / m.n_experts
    for e in range(m.n_experts // ep):
        out += [Matmul(f"expert{e}.gate", d, m.d_ff, rows, "column"), Matmul(f"expert{e}.up", d, m.d_ff, rows, "column"),
                Matmul(f"expert{e}.proj", m.d_ff, d, rows, "row")]
    if m.n_shared:
        f = m.n_shared * m.d_ff
        out += [Matmul("shared.gate", d, f, 1, "column"), Matmul("shared.up", d, f, 1, "column"),
                Matmul("shared.proj", f, d, 1, "row")]
    return out


def kept_by_op(matmuls: list) -> list[bool]:
    """Which of a block's matmuls the ``op`` policy keeps: the 1st, 3rd, 5th, ..."""
    return [i % 2 == 0 for i in range(len(matmuls))]


FP8_ALIGN = 16
"""torchao's float8 matmuls take a linear whose input and output widths are multiples of 16."""


_MODULE = {"q": "attn.q", "k": "attn.k", "v": "attn.v", "out": "attn.out", "q_a": "attn.q_a", "q_b": "attn.q_b",
           "kv_a": "attn.kv_a", "kv_b": "attn.kv_b", "router": "mlp.router.score",
           "shared.gate": "mlp.shared.gate", "shared.up": "mlp.shared.up", "shared.proj": "mlp.shared.proj"}
"""A block matmul's ``nn.Linear`` in :class:`workloads.model.Block` (the MLP's others are ``mlp.<name>``)."""


def _fp8_matmuls(size: ModelSize) -> list[Matmul]:
    """A block's matmuls ``--precision fp8`` converts: its ``nn.Linear`` layers (an MoE's stacked experts are not;
    its router is) whose widths are multiples of :data:`FP8_ALIGN`."""
    return [m for m in block_matmuls(size)
            if not m.name.startswith("expert") and m.k % FP8_ALIGN == 0 and m.n % FP8_ALIGN == 0]


def fp8_linears(size: ModelSize) -> list[str]:
    """The linears ``--precision fp8`` trains in float8, named as in the model (``blocks.0.attn.q``), never the LM
    head: the list a record's converted linears must equal."""
    return [f"blocks.{i}.{_MODULE.get(m.name, f'mlp.{m.name}')}" for i in range(size.n_layers)
            for m in _fp8_matmuls(size.at_layer(i))]


def fp8_flops_fraction(size: ModelSize) -> float:
    """The share of a step's model FLOPs (:meth:`ModelSize.flops_per_token`) that ``--precision fp8`` runs in float8:
    its converted linears' 6 FLOPs per weight per token (forward and both backward matmuls). The rest, the
    attention's scores and values, the LM head, an MoE's experts, stays bf16."""
    weights = sum(m.k * m.n for i in range(size.n_layers) for m in _fp8_matmuls(size.at_layer(i)))
    return 6 * weights / size.flops_per_token()
