"""A workload in words and as a record: what the records' ``workload`` holds (:func:`workload_record`), the block in
one line (:func:`block_summary`), and why a sequence length cannot run on it (:func:`seq_len_error`)."""

from __future__ import annotations

from workloads.architecture import DEFAULT_ARCH, ModelSize


def workload_record(size: ModelSize) -> dict:
    """A workload as its record keeps it: the size, its counts, what a family adds (a gpt2 record keeps what it always
    had), an MoE's experts, a config model's block and source."""
    out = {
        "name": size.name,
        "n_layers": size.n_layers,
        "d_model": size.d_model,
        "n_heads": size.n_heads,
        "seq_len": size.seq_len,
        "vocab_size": size.vocab_size,
        "params": size.params,
        "params_nonembedding": size.params_nonembedding,
        "flops_per_token": size.flops_per_token(),
        "flops_per_token_megatron": size.flops_per_token_megatron(),
    }
    if size.arch != DEFAULT_ARCH:  # gpt2 records keep the workload they always had
        out.update(arch=size.arch, n_kv_heads=size.kv_heads, d_ff=size.d_ff, rope_theta=size.rope_theta,
                   params_published=size.params_published,
                   flops_per_token_torchtitan=size.flops_per_token_torchtitan())
    if size.moe is not None:
        m = size.moe
        out.update(head_dim=size.head_dim, n_experts=m.n_experts, top_k=m.top_k, n_shared_experts=m.n_shared,
                   balancing=m.balancing, params_active=size.params_active,
                   flops_per_token_total=size.flops_per_token_total())
    if size.origin is not None:
        out.update(block=block_summary(size), model=size.origin.as_dict())
    return out


def block_summary(size: ModelSize) -> str:
    """The block in one line: what a config model mapped onto (records, ``harness workloads``)."""
    attn = (f"MLA (q rank {size.mla.q_rank}, kv rank {size.mla.kv_rank}, heads {size.n_heads} x "
            f"{size.mla.nope_dim}+{size.mla.rope_dim}/{size.mla.v_dim})" if size.mla is not None
            else f"{'MHA' if size.kv_heads == size.n_heads else 'GQA'} {size.n_heads}/{size.kv_heads} x "
                 f"{size.head_dim}")
    pos = {"learned": f"learned positions ({size.position_rows})", "alibi": "ALiBi",
           "rope": f"RoPE theta {size.rope_theta:g}" + (f" on {size.rotary_dim} of {size.head_dim}"
                                                        if size.rotary_dim != size.head_dim else "")}[size.positions]
    parts = [f"{size.norm}{'' if size.norm_bias or size.norm == 'rmsnorm' else ' (no bias)'}"
             + (" after" if size.norm_after else ""), attn, pos]
    if size.qk_norm:
        parts.append(f"q/k norm per {'head' if size.qk_norm == 'head' else 'projection'}")
    parts.append("biases" if size.bias else "qkv biases" if size.qkv_bias else "no biases")
    if size.parallel_residual:
        parts.append("parallel residual")
    if size.moe is not None:
        m = size.moe
        route = f"{m.score} top-{m.top_k} of {m.n_experts}" + (
            f" in {m.topk_group} of {m.n_group} groups" if m.n_group > 1 else "")
        parts.append(f"MoE {route}, expert d_ff {m.d_ff}" + (f", {m.n_shared} shared" if m.n_shared else "")
                     + (f", first {size.dense_layers} dense (d_ff {size.layer_ff(0)})" if size.dense_layers else ""))
    else:
        parts.append(f"{size.mlp} d_ff {size.dense_ff}")
    return "; ".join(parts)


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
