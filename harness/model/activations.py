"""What one block saves for its backward, per token, on one rank: every architecture's parts, every AC policy.

Korthikanti et al. (2022, section 4), adapted to this model: no dropout, fused SDPA attention that saves its
output and log-sum-exp instead of the ``5 a s^2 b`` score matrices. Per layer and token, on one tp rank:

* **norms**: each norm's input (sequence-sharded under SP) and its output, which the next linears save whole
  (all-gathered: DTensor does not re-gather in backward as Megatron does); a composite RMSNorm (a block's on CPU only:
  :func:`composite_block_norm`) also its normalised input, both in fp32. A parallel residual's
  two norms read one input; norms after each sub-layer (OLMo 2) save the same tensors by other names (the
  sub-layer's output in, the residual stream into the next sub-layer's linears);
* **attention**: q, k and v (k and v gathered whole under context parallel) and the output, in the compute dtype;
  where RoPE made q contiguous per head, a CPU's flash kernel lays its output out per head, and the output
  projection saves a copy of it; q/k norms per head save as a composite norm does, over the whole projection
  (:class:`workloads.layers.ProjNorm`) their fp32 input and normalised copy;
* **multi-head latent attention**: the low-rank path (q_a's output, its norm's, kv_a's latent, whole on every tp
  rank), then q, k and v of every local head; where v is narrower than q and k a CPU runs SDPA's math path, which
  saves the probabilities (a head's row of the sequence per token) and contiguous copies of k, v and q;
* **MLP**: GELU's input and output (2 d_ff), or SwiGLU's gate, silu(gate), up and their product (4 d_ff); an MoE
  layer its routed rows (:func:`moe_token_bytes`); an MoE model's dense first blocks their own width
  (:meth:`harness.model.shape.CellShape.at_layer`).

Per microbatch, not per row: RoPE's cos and sin tables, and ALiBi's bias (heads x queries x keys), which SDPA keeps.
Recompute ``full`` keeps only each block's input; ``attn`` drops what the attention core saves but its output;
``op`` keeps every other matmul's output (:func:`op_token_bytes`). Checked against a real block's live tensors for
every architecture (tests/unit/test_ac_policies.py, tests/unit/test_config_activations.py).
"""

from __future__ import annotations

from harness.model.block_ops import block_matmuls, kept_by_op
from harness.model.shape import CellShape
from harness.parallel.activation_checkpoint import checkpointed_layer


def composite_rms_norm(c: CellShape) -> bool:
    """Whether an ``nn.RMSNorm`` that reads a linear's output (q/k norms, MLA's latent norms) runs as composite ops,
    which also save the normalised input: on CPU always (torch 2.13 fuses it on CUDA only), on CUDA when that output's
    dtype (autocast's) differs from the fp32 weight's (autocast without FSDP's low-precision ``param_dtype``)."""
    return c.device_kind != "cuda" or (c.compute_bytes != 4 and not c.fsdp)


def composite_block_norm(c: CellShape) -> bool:
    """Whether a block's own RMSNorms run as composite ops: on CPU always; on CUDA never. They read the residual stream,
    which has the weight's dtype in every mode (fp32 under autocast without FSDP, where the residual adds run in fp32:
    :attr:`CellShape.residual_bytes`; FSDP's ``param_dtype`` for both under FSDP), and torch's ``rms_norm`` runs the
    fused kernel wherever input and weight dtypes agree (``rms_norm_symint``: the composite ops on a mismatch only).
    The H200's llama3 1b bf16 cells bound it (docs/model-accuracy.md, "Mixed precision"): under ``ac attn`` the loss's backward holds every
    saved activation, and the composite's normalised copies (4.0 GiB) would put that moment 3.7 GiB above the
    allocator's measured peak."""
    return c.device_kind != "cuda"


def _sp(c: CellShape) -> int:
    return c.dims.tp if c.dims.sequence_parallel else 1


def _norm_token_bytes(c: CellShape) -> float:
    """The block's two norms (the module docstring)."""
    size, hi, d = c.size, c.residual_bytes, c.size.d_model
    composite = size.norm == "rmsnorm" and composite_block_norm(c)
    inputs = (1 if size.parallel_residual else 2) * d * (4 if composite else hi)
    normalised = 2 * d * 4 if composite else 0
    return (inputs + normalised) / _sp(c) + 2 * d * hi


def _attention_token_elements(c: CellShape) -> float:
    """q, k, v and the attention output, per token, on one tp rank; under context parallel k and v are the whole
    sequence's, gathered: ``cp`` times the local tokens'."""
    size = c.size
    kv = size.kv_dim + size.kv_heads * size.v_head_dim
    return (size.q_dim + size.v_dim + kv * c.dims.cp) / c.dims.tp


def out_copy(c: CellShape) -> bool:
    """Whether the output projection saves a copy of the attention's output: on a CPU (not ``fit``'s fake compute,
    which stands for a GPU's kernel) where q is contiguous per head, RoPE's rotation or MLA's concatenation having
    made it so, the flash kernel lays its output out per head, and ``transpose(1, 2).reshape`` copies it (measured
    with saved-tensor hooks; a GPU's kernel lays it out per token: no copy)."""
    return c.device_kind == "cpu" and not c.fake_compute and c.size.rotary_dim > 0


def math_attention(c: CellShape) -> bool:
    """Whether SDPA runs its math path (MLA's values narrower than its queries on a CPU): no fused kernel takes
    them there."""
    return c.size.v_head_dim != c.size.head_dim and c.device_kind == "cpu" and not c.fake_compute


def _qk_norm_token_bytes(c: CellShape) -> float:
    size = c.size
    width = (size.q_dim + size.kv_dim) / c.dims.tp
    if size.qk_norm == "head":  # saved as the layer norms are
        return width * (2 * 4 if composite_rms_norm(c) else c.compute_bytes)
    if size.qk_norm == "proj":  # its fp32 input and the normalised copy its weight multiplies
        return width * (4 + c.compute_bytes)
    return 0.0


def _latent_token_bytes(c: CellShape) -> float:
    """MLA's low-rank path, whole on every tp rank: q_a's output through its norm into q_b, kv_a's latent through
    its norm into kv_b (a composite norm's fp32 input and normalised copy beside its output; a fused one its input
    and output)."""
    m, lo = c.size.mla, c.compute_bytes
    assert m is not None
    composite = composite_rms_norm(c)
    per_norm = (4 + 4 + lo) if composite else 2 * lo
    latent_in = (m.rope_dim * 4 if composite and lo == 4 else m.rope_dim * lo if not composite else 0)
    return per_norm * (m.q_rank + m.kv_rank) + latent_in


def _attention_token_bytes(c: CellShape) -> float:
    """Everything the attention saves per token but the out projection's input (the module docstring)."""
    size, tp, lo = c.size, c.dims.tp, c.compute_bytes
    if size.mla is not None and math_attention(c):  # q, k, contiguous v and the probabilities (keys in a row)
        heads, cp = size.n_heads / tp, c.dims.cp
        saved = heads * (size.head_dim * (1 + cp) + size.v_head_dim * cp + size.seq_len) * lo
    else:
        saved = (_attention_token_elements(c) - size.v_dim / tp) * lo
    if size.mla is not None:
        saved += _latent_token_bytes(c)
    return saved + _qk_norm_token_bytes(c)


def _mlp_token_bytes(c: CellShape) -> float:
    size = c.size
    if size.moe is not None:  # k expert slots per token instead of one MLP
        return moe_token_bytes(c)
    return (2 * size.mlp_matrices - 2) * size.d_ff / c.dims.tp * c.compute_bytes


def block_token_bytes(c: CellShape) -> float:
    """Bytes one block saves per token for its backward (under ``attn``, what it keeps; every other policy
    recomputes a block to this in its backward)."""
    out_input = c.size.v_dim / c.dims.tp * c.compute_bytes  # SDPA's output, or the copy the out projection saves
    fused_out = out_copy(c) and not math_attention(c)  # a fused kernel keeps its own output beside the copy
    attention = 0.0 if c.recompute == "attn" else _attention_token_bytes(c) + (out_input if fused_out else 0.0)
    return _norm_token_bytes(c) + attention + out_input + _mlp_token_bytes(c)


def op_token_bytes(c: CellShape) -> float:
    """What the ``op`` policy keeps of a block per token (:class:`harness.parallel.activation_checkpoint.EveryOtherMatmul`):
    the block's input (the checkpoint's; sequence-sharded under SP), the 1st, 3rd, ... matmul's output, the
    attention's output and its fp32 log-sum-exp (a head per token), and under sequence parallel the reduce-scatters'
    outputs (the attention's, and a dense MLP's; an MoE's output is sliced, not reduce-scattered). Checked
    against a real block's live tensors (tests/unit/test_ac_policies.py)."""
    size, tp, lo = c.size, c.dims.tp, c.compute_bytes
    outputs = [m.output_bytes(tp, lo) for m in block_matmuls(size, c.dims.ep)]
    attention = size.v_dim / tp * lo + size.n_heads / tp * 4  # SDPA's output and log-sum-exp
    if math_attention(c):  # its two batched matmuls count as matmuls, before the output projection's
        at = next(i for i, m in enumerate(block_matmuls(size, c.dims.ep)) if m.name == "out")
        outputs[at:at] = [size.n_heads / tp * size.seq_len * lo, size.v_dim / tp * lo]  # probabilities, values
        attention = 0.0
    kept = sum(out for out, keep in zip(outputs, kept_by_op(outputs)) if keep)
    scattered = (1 if size.moe else 2) * size.d_model / tp * lo if c.dims.sequence_parallel else 0
    return size.d_model * c.residual_bytes / _sp(c) + kept + attention + scattered


def kept_token_bytes(c: CellShape, layer: int) -> float:
    """Bytes block ``layer`` keeps per token for its backward under the cell's policy: its input only when it is
    checkpointed whole (``full``, ``layerN``), :func:`op_token_bytes` under ``op``, else
    :func:`block_token_bytes`."""
    if checkpointed_layer(c.recompute, layer):
        return c.size.d_model * c.residual_bytes / _sp(c)
    if c.recompute == "op":
        return op_token_bytes(c.at_layer(layer))
    return block_token_bytes(c.at_layer(layer))


def moe_token_bytes(c: CellShape) -> float:
    """What an MoE layer saves per token: the router's fp32 logits and scores (E each); per each of the k
    slots, three rows of d: the token's grouped copy (the experts' input), its expert's output (which the
    routing weight multiplies) and the weighted output (``index_add`` keeps its source), and the
    expert's SwiGLU tensors (4 f); the shared expert's SwiGLU tensors (4 x n_shared f). Under tensor parallel
    (``fsdp+tp+ep``) every tp rank routes the same tokens, each computing its ``1 / tp`` of the experts' width."""
    m, d, tp = c.size.moe, c.size.d_model, c.dims.tp
    assert m is not None, f"moe_token_bytes: {c.size.key} has no MoE layer"
    return 8 * m.n_experts + (m.top_k * (3 * d + 4 * m.d_ff / tp) + 4 * m.n_shared * m.d_ff / tp) * c.compute_bytes


def _attention_kept(c: CellShape, layer: int) -> bool:
    return c.recompute not in ("attn", "op") and not checkpointed_layer(c.recompute, layer)


def rope_table_bytes(c: CellShape, layer: int) -> int:
    """RoPE's cos and sin (fp32, ``seq x rotary width / 2`` each), computed and saved by a block's attention that
    keeps it (no policy that recomputes the attention), once per microbatch: not per row."""
    return 4 * c.local_seq * c.size.rotary_dim if _attention_kept(c, layer) else 0


def alibi_bias_bytes(c: CellShape, layer: int) -> int:
    """ALiBi's bias, ``heads / tp x queries x keys`` in the compute dtype, made by a block's attention and kept by
    SDPA, once per microbatch (under context parallel each of the rank's two chunks' queries over the keys up to
    their chunk's end)."""
    if c.size.positions != "alibi" or not _attention_kept(c, layer):
        return 0
    heads = c.size.n_heads // c.dims.tp
    if c.dims.cp == 1:
        return heads * c.local_seq * c.local_seq * c.compute_bytes
    chunk = c.size.seq_len // (2 * c.dims.cp)
    ends = sum(chunk * (j + 1) for j in (0, 2 * c.dims.cp - 1))  # rank 0's two chunks: the largest is the last's
    return heads * chunk * ends * c.compute_bytes


def microbatch_tables(c: CellShape, layer: int) -> int:
    """What block ``layer`` keeps once per microbatch, not per row: RoPE's tables, ALiBi's bias."""
    return rope_table_bytes(c, layer) + alibi_bias_bytes(c, layer)


def mlp_grad_bytes(c: CellShape) -> int:
    """The MLP gradients one block's backward allocates, one microbatch: GELU's (``d_ff / tp`` per
    token), or SwiGLU's two at once (the gradients of silu(gate) and of up: ``2 d_ff / tp``)."""
    width = (c.size.mlp_matrices - 1) * c.size.d_ff
    return int(c.microbatch_rows * c.local_seq * width * c.compute_bytes / c.dims.tp)


def block_backward_bytes(c: CellShape) -> int:
    """Activations live in one block's backward, one microbatch: the block's (saved, or recomputed
    under every policy but ``attn``) and its MLP gradients."""
    return int(c.microbatch_rows * c.local_seq * block_token_bytes(c)) + mlp_grad_bytes(c)
