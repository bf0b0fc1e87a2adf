"""The model's expert-parallel and memory terms in the combinations one-at-a-time tests left out (issue 44): expert
parallel under activation checkpointing (a policy that reruns some layers' forward, with their all-to-alls), the
rows a record counted in rerun layers, the tp all-reduces of ``fsdp+tp+ep``, and RMSNorm's, an MoE layer's and the
``op`` policy's saved bytes on the devices and layouts that change them.

Every expected value is worked by hand in the comments from the sizes' shapes (moe tiny: 4 layers, d 128, 8 experts
of SwiGLU width 128, top-2; sequence 128; gpt2 tiny: d 128, 4 heads, MLP 512), never read back from the model.
"""

from __future__ import annotations

import pytest

from harness.model.activations import composite_rms_norm, moe_token_bytes, op_token_bytes
from harness.model.comm import _ep_calls, comm_by_rank, comm_for_routing, ep_bytes, ep_tp_bytes
from harness.model.inventory import coords
from harness.model.shape import CellShape
from harness.parallel.presets import resolve, resolve_cell
from workloads.sizes import get_size

MOE = get_size("tiny", "moe")
ROWS_BYTES = 4 * 128 * 2 * 128 * 4
"""One dispatch's bytes on a rank of the cells below: 4 local sequences x 128 tokens x top-2 rows of d 128, fp32."""


def _moe(strategy: str, degrees: dict, recompute: str = "none") -> CellShape:
    layout, _ = resolve_cell(strategy, 4, degrees, MOE, "fp32", pp_schedule="1f1b", microbatches=None, grad_accum=1,
                             global_batch=16)
    return CellShape(size=MOE, dims=layout.dims, strategy=strategy, precision="fp32", global_batch=16,
                     recompute=recompute)


def test_a_rerun_layer_sends_its_forward_all_to_alls_again():
    """layer2 checkpoints layers 2 and 4 (1-based): their forward's count exchange (8 bytes x 8 experts) and two
    row exchanges run twice, the backward's two once. Per step on rank 0: layers 1, 3 make 1 + 2 + 2 = 5 calls,
    64 + 4 R bytes; layers 2, 4 make 2 x 3 + 2 = 8 calls, 128 + 6 R bytes."""
    c = _moe("fsdp+ep", {"dp_shard": 4, "ep": 2}, recompute="layer2")
    a2a = comm_by_rank(c)[0]["all_to_all"]
    assert a2a == {"calls_per_step": 2 * 5 + 2 * 8, "bytes_per_step": 2 * (64 + 4 * ROWS_BYTES) + 2 * (128 + 6 * ROWS_BYTES)}
    # the same through the routed rows: 4,096 sent and received over the 4 layers, half of them in rerun layers
    rows = 4 * 128 * 2 * 4
    assert ep_bytes(c, rows, rows) == 1.5 * 64 * 4 + (2 * 2 * rows + 2 * rows // 2) * 128 * 4
    assert (c.grad_accum, c.local_batch) == (1, 4)  # one pass of 4 rows
    calls = _ep_calls(c, coords(c.dims)[0])
    assert len(calls) == 26 and {(k.collective, k.group, k.dim, k.overlappable) for k in calls} == {
        ("all_to_all", 2, "ep", False)}, "expert parallel's exchanges run over ep and nothing hides them"


def test_counted_rerun_rows_replace_the_layers_share():
    """A record that counted the rows its rerun layers sent (1,000) and received (3,000) is priced on them, not on
    the policy's share (half of 4,096 sent, half of 4,000 received): 384 count bytes (1.5 forwards x 8 x 8 x 4
    layers), then 2 x (sent + received) + rerun sent + rerun received rows of d 128 in fp32."""
    c = _moe("fsdp+ep", {"dp_shard": 4, "ep": 2}, recompute="layer2")
    assert ep_bytes(c, 4096, 4000, 1000, 3000) == 384 + (2 * (4096 + 4000) + 1000 + 3000) * 512
    assert ep_bytes(c, 4096, 4000) == 384 + (2 * (4096 + 4000) + 2048 + 2000) * 512
    routing = {"counted_step_rows_sent_by_rank": [4096, 4000, 4096, 4000],
               "counted_step_rows_received_by_rank": [4000, 4096, 4000, 4096],
               "counted_step_rerun_rows_sent_by_rank": [1000, 0, 1000, 0],
               "counted_step_rerun_rows_received_by_rank": [3000, 0, 3000, 0]}
    by_rank = comm_for_routing(c, routing)
    assert [r["all_to_all"]["bytes_per_step"] for r in by_rank] == [
        384 + (2 * 8096 + 4000) * 512, 384 + 2 * 8096 * 512, 384 + (2 * 8096 + 4000) * 512, 384 + 2 * 8096 * 512]


def test_the_experts_tp_all_reduces_count_rerun_forwards_in_the_compute_dtype():
    """fsdp+tp+ep: each received row's expert output is all-reduced over tp in every forward (compute dtype) and its
    gradient once (residual dtype): 128 x ((4,000 + 3,000) x 4 + 4,000 x 4) bytes with 3,000 rows rerun."""
    c = _moe("fsdp+tp+ep", {"dp_shard": 2, "tp": 2, "ep": 2}, recompute="layer2")
    assert ep_tp_bytes(c, 4000, 3000) == 128 * (7000 * 4 + 4000 * 4)
    assert ep_tp_bytes(c, 4000) == 128 * (6000 * 4 + 4000 * 4), "without counts: half the rows in rerun layers"
    routing = {"counted_step_rows_sent_by_rank": [4096] * 4, "counted_step_rows_received_by_rank": [4000] * 4,
               "counted_step_rerun_rows_sent_by_rank": [0] * 4, "counted_step_rerun_rows_received_by_rank": [3000] * 4}
    planned = comm_by_rank(c)[0]["all_reduce"]["bytes_per_step"]
    counted = comm_for_routing(c, routing)[0]["all_reduce"]["bytes_per_step"]
    assert counted - planned == 128 * (7000 * 4 + 4000 * 4) - 128 * (6144 * 4 + 4096 * 4)


@pytest.mark.parametrize("device, precision, strategy, composite", [
    ("cpu", "fp32", "ddp", True),     # torch fuses RMSNorm on CUDA only
    ("cuda", "fp32", "ddp", False),   # fp32 input, fp32 weight: fused
    ("cuda", "bf16", "ddp", True),    # autocast: a bf16 input against the fp32 weight runs the composite ops
    ("cuda", "bf16", "fsdp", False),  # FSDP's bf16 param_dtype: weight and input agree, fused
])
def test_rms_norm_is_composite_where_torch_does_not_fuse_it(device, precision, strategy, composite):
    dims = resolve(strategy, 2).dims
    c = CellShape(size=get_size("tiny", "llama3"), dims=dims, strategy=strategy, precision=precision, global_batch=4,
                  device_kind=device)
    assert composite_rms_norm(c) is composite


def test_an_moe_layer_saves_its_router_scores_in_fp32_and_its_rows_in_the_compute_dtype():
    # router logits and scores: 2 x 8 experts x 4 bytes; per each of 2 slots 3 rows of d 128 and 4 SwiGLU rows of 128
    fp32 = _moe("fsdp+ep", {"dp_shard": 4, "ep": 2})
    assert moe_token_bytes(fp32) == 64 + 2 * (3 * 128 + 4 * 128) * 4
    bf16 = CellShape(size=MOE, dims=fp32.dims, strategy="fsdp+ep", precision="bf16", global_batch=16)
    assert moe_token_bytes(bf16) == 64 + 2 * (3 * 128 + 4 * 128) * 2


def test_the_op_policy_keeps_the_whole_input_under_tp_without_sequence_parallel():
    """gpt2 tiny, tp 2, fp32, no SP: the block's input whole (128 x 4), the 1st, 3rd and 5th matmuls' outputs (q, v,
    fc: column-parallel, 64 + 64 + 256 wide), the attention output (64) and its log-sum-exp (2 heads, fp32)."""
    dims = resolve("tp", 2).dims
    assert not dims.sequence_parallel
    c = CellShape(size=get_size("tiny"), dims=dims, strategy="tp", precision="fp32", global_batch=4, recompute="op")
    assert op_token_bytes(c) == 128 * 4 + (64 + 64 + 256) * 4 + 64 * 4 + 2 * 4


def test_a_blocks_matmuls_with_experts_over_ep_and_shared_experts_by_hand():
    """moe mini with experts 96 wide and 2 shared: d 256, q 256 (8 heads of 32), k and v 128 (4 KV heads); the router
    over 8 experts replicated; under ep 2 a rank holds 4 experts, each fed k ep / E = 2 x 2 / 8 = 0.5 rows per token;
    the shared experts one SwiGLU 2 x 96 = 192 wide on every token."""
    from dataclasses import replace

    from harness.model.block_ops import Matmul, block_matmuls

    base = get_size("mini", "moe")
    size = replace(base, moe=replace(base.moe, d_ff=96, n_shared=2))
    expected = [Matmul("q", 256, 256, 1, "column"), Matmul("k", 256, 128, 1, "column"),
                Matmul("v", 256, 128, 1, "column"), Matmul("out", 256, 256, 1, "row"),
                Matmul("router", 256, 8, 1, "replicated")]
    for e in range(4):
        expected += [Matmul(f"expert{e}.gate", 256, 96, 0.5, "column"), Matmul(f"expert{e}.up", 256, 96, 0.5, "column"),
                     Matmul(f"expert{e}.proj", 96, 256, 0.5, "row")]
    expected += [Matmul("shared.gate", 256, 192, 1, "column"), Matmul("shared.up", 256, 192, 1, "column"),
                 Matmul("shared.proj", 192, 256, 1, "row")]
    assert block_matmuls(size, ep=2) == expected
    # dense: gpt2's fc and proj (MLP 512), llama3's gate, up and proj (SwiGLU 352)
    assert block_matmuls(get_size("tiny"))[4:] == [Matmul("fc", 128, 512, 1, "column"), Matmul("proj", 512, 128, 1, "row")]
    assert block_matmuls(get_size("tiny", "llama3"))[4:] == [
        Matmul("gate", 128, 352, 1, "column"), Matmul("up", 128, 352, 1, "column"), Matmul("proj", 352, 128, 1, "row")]


def test_a_split_backward_holds_each_linears_and_norms_output_gradient_and_the_heads_on_the_last_stage():
    """gpt2 tiny under pp 2 x tp 2 (zb: 4 stages of one block), 4 microbatches of 2 sequences of 128 tokens, fp32,
    torch's own split run at these shapes: the input pass holds, per token, the gradient at each linear's output (q,
    k, v, out 128 each, fc 512: 1,024 wide; proj's is the stage output's gradient, received and counted with the
    receive buffers) and at each LayerNorm's (2 x 128), and one vector the size of each of the block's 1-D parameters
    (the six linears' biases, the two norms' weights and biases: 9 x 128 + 512), over tp 2; on the last stage also
    the logits' (vocab 256, fp32, over tp 2). The first stage splits nothing: its input needs no gradient."""
    from harness.model.memory import _split_passes

    layout, _ = resolve_cell("pp+fsdp+tp", 4, {"pp": 2, "tp": 2, "dp_shard": 1}, get_size("tiny"), "fp32",
                             pp_schedule="zb", microbatches=4, grad_accum=1, global_batch=8)
    c = CellShape(size=get_size("tiny"), dims=layout.dims, strategy="pp+fsdp+tp", precision="fp32", global_batch=8,
                  microbatches=4, pp_schedule="zb")
    tokens = 2 * 128
    block = (tokens * (1024 + 2 * 128) + 9 * 128 + 512) * 4 // 2
    rank0, rank1 = _split_passes(c, 0), _split_passes(c, 1)
    assert (rank0[0], rank0[2][0], rank1[1][0]) == ((0, 0), block, block)
    assert rank1[3][0] == block + tokens * 256 * 4 // 2
