"""The op-by-op what-if (harness/model/op_cost.py, op_trace.py, op_step.py): values worked by hand beside each
expected figure, and the trace held against independent counts (the block's own matmul list, the FlashAttention
papers' count)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from harness.model.block_ops import block_matmuls, kept_by_op
from harness.model.op_cost import (
    AttentionTable,
    Device,
    OpRates,
    fuse,
    op_seconds,
    price,
    split_for_tp,
    wave_efficiency,
)
from harness.model.op_record import ATTENTION, BACKWARD, FORWARD, GEMM, MEMORY, RECOMPUTE, SYNC, Op
from harness.model.op_trace import TraceSpec, trace_block
from workloads.model_parts import MoESpec
from workloads.sizes import get_size

TABLE = AttentionTable(peak=1000.0, seq=(1024, 4096), fwd=((128, (300.0, 400.0)),), fwd_bwd=((128, (250.0, 350.0)),))
RATES = OpRates(gemm_tflops=(("bf16", 700.0),), sms=132, attention=TABLE, bandwidth_efficiency=0.5, launch_s=10e-6,
                tile=(128, 128))
DEV = Device(rates=RATES, peak_tflops={"bf16": 1000.0}, hbm_gbps=4000.0)
"""Memory at 0.5 x 4,000 GB/s = 2e12 B/s; GEMMs at 700 TFLOP/s x wave efficiency."""


def gemm(m: int, n: int, k: int, **kw) -> Op:
    return Op(name="mm", kind=GEMM, phase=FORWARD, module="", flops=2.0 * m * n * k, read=2 * (m * k + k * n),
              written=2 * m * n, dtype="bf16", gemm=(1, m, n, k), **kw)


def test_a_large_gemm_at_its_waves():
    # 4096^3: 32 x 32 = 1,024 tiles of 128 x 128 over 132 SMs: ceil(1024 / 132) = 8 waves of 132 = 1,056 slots,
    # efficiency 1024 / 1056 = 0.969697; 2 x 4096^3 = 1.374390e11 FLOPs / (700e12 x 0.969697) = 2.024770e-4 s
    # (its bytes, 3 x 4096^2 x 2 = 1.00663e8 over 2e12 B/s = 5.03e-5 s: compute-bound)
    op = gemm(4096, 4096, 4096)
    assert wave_efficiency(op, RATES) == pytest.approx(1024 / 1056)
    assert op_seconds(op, DEV) == pytest.approx(2.024770e-4, rel=1e-6)


def test_an_expert_gemm_of_a_few_rows_fills_one_partial_wave():
    # an MoE expert: 2,048 rows x 768 wide from 4,096: 16 x 6 = 96 tiles, one wave of 132 slots: efficiency
    # 96 / 132 = 0.72727; 2 x 2048 x 768 x 4096 = 1.28849e10 FLOPs / (700e12 x 0.72727) = 2.53095e-5 s
    op = gemm(2048, 768, 4096)
    assert wave_efficiency(op, RATES) == pytest.approx(96 / 132)
    assert op_seconds(op, DEV) == pytest.approx(2.53095e-5, rel=1e-5)


def test_a_gemm_too_thin_for_its_flops_is_bound_by_its_bytes():
    # 65,536 x 16 from 16: 2 x 65536 x 16 x 16 = 3.35544e7 FLOPs (512 x 1 tiles, 4 waves: efficiency 512/528 ->
    # 4.94e-8 s); bytes 2 x (65536 x 16 + 256) + 2 x 65536 x 16 = 4,194,816 / 2e12 = 2.097408e-6 s
    op = gemm(65536, 16, 16)
    assert op_seconds(op, DEV) == pytest.approx(4_194_816 / 2e12)


def test_a_memory_bound_op_is_its_bytes_over_the_achievable_bandwidth():
    # 1e9 bytes read + 5e8 written over 0.5 x 4,000 GB/s = 1.5e9 / 2e12 = 7.5e-4 s
    op = Op(name="add", kind=MEMORY, phase=FORWARD, module="", flops=0.0, read=1_000_000_000, written=500_000_000)
    assert op_seconds(op, DEV) == pytest.approx(7.5e-4)


def test_attention_at_the_measured_rate_for_its_length_forward_and_backward():
    # forward at seq 2048, between 1024 (300) and 4096 (400) in log(seq): halfway, 350 TFLOP/s of a 1,000 peak,
    # 0.35 of this device's 1,000; 1e12 FLOPs / 350e12 = 2.857143e-3 s
    fwd = Op(name="attention", kind=ATTENTION, phase=FORWARD, module="attn", flops=1e12, read=0, written=0,
             dtype="bf16", attn=(32, 2048, 2048, 128, 128))
    assert op_seconds(fwd, DEV) == pytest.approx(1e12 / 350e12)
    # backward at 1024: what forward+backward (250) leaves after the forward (300): 2.5 / (3.5/250 - 1/300)
    # = 2.5 / (0.014 - 0.0033333) = 234.375 TFLOP/s
    bwd = replace(fwd, phase=BACKWARD, attn=(32, 1024, 1024, 128, 128))
    assert op_seconds(bwd, DEV) == pytest.approx(1e12 / 234.375e12)


def test_a_pass_waits_for_the_host_where_its_kernels_are_small_and_for_a_sync():
    # two 1 us kernels (2e6 bytes each over 2e12 B/s) launched 10 us apart: the GPU idles waiting for launches;
    # host 10 + 10 = 20 us, the second kernel ends at 20 + 1 = 21 us
    tiny = Op(name="mul", kind=MEMORY, phase=FORWARD, module="", flops=0.0, read=1_000_000, written=1_000_000)
    cost = price([tiny, tiny], DEV)
    assert cost.gpu_s == pytest.approx(2e-6)
    assert cost.total_s == pytest.approx(21e-6)
    # a 1 ms kernel, a sync, then a tiny one: the host waits for the GPU (at 10 + 1000 us), launches (+10 us), and
    # the tiny kernel ends 1 us later: 1,021 us
    big = replace(tiny, read=1_000_000_000, written=1_000_000_000)
    sync = Op(name="counts.tolist", kind=SYNC, phase=FORWARD, module="mlp", flops=0.0, read=0, written=0)
    assert price([big, sync, tiny], DEV).total_s == pytest.approx(1021e-6)


def mem(name: str, reads: list[tuple[int, int]], writes: list[tuple[int, int]], phase: str = FORWARD) -> Op:
    return Op(name=name, kind=MEMORY, phase=phase, module="", flops=0.0, read=sum(b for _, b in reads),
              written=sum(b for _, b in writes), reads=tuple(reads), writes=tuple(writes))


def test_compile_fuses_a_run_of_memory_bound_ops_into_what_crosses_its_edges():
    # GEMM writes A (100); norm reads A writes B (100); cast reads B writes C (50); GEMM reads C. B is read only
    # inside the run: the fused op reads A and writes C: 100 + 50 = 150 bytes, not 100+100 + 100+50 = 350
    g1 = replace(gemm(8, 8, 8), writes=((1, 100),))
    g2 = replace(gemm(8, 8, 8), reads=((3, 50),))
    ops = [g1, mem("norm", [(1, 100)], [(2, 100)]), mem("cast", [(2, 100)], [(3, 50)]), g2]
    fused = fuse(ops)
    assert [o.kind for o in fused] == [GEMM, MEMORY, GEMM]
    assert (fused[1].read, fused[1].written) == (100, 50)
    # the same run with B saved for the backward (a backward op reads it): B is written too, 150 + 100 = 250
    saved = ops + [mem("norm_backward", [(2, 100)], [(4, 100)], phase=BACKWARD)]
    assert fuse(saved)[1].bytes == 250
    # a run never crosses from forward into backward
    assert len([o for o in fuse(saved) if o.kind == MEMORY]) == 2


def test_a_compiled_kernel_with_a_norm_in_it_runs_at_the_inductor_share_of_the_bandwidth():
    # residual add (reads A 400, writes B 400) then a norm (reads B, writes C 200) between two GEMMs: one kernel of
    # 400 read + 200 written = 600 bytes. At the 2e12 B/s of DEV: 3e-10 s; under the torch of 2024's Inductor
    # (half the bandwidth in a kernel with a reduction): 600 / 1e12 = 6e-10 s
    g1 = replace(gemm(8, 8, 8), writes=((1, 400),))
    g2 = replace(gemm(8, 8, 8), reads=((3, 200),))
    ops = [g1, mem("add", [(1, 400)], [(2, 400)]), mem("rms_norm", [(2, 400)], [(3, 200)]), g2]
    assert op_seconds(fuse(ops)[1], DEV) == pytest.approx(600 / 2e12)
    assert op_seconds(fuse(ops, reduction_share=0.5)[1], DEV) == pytest.approx(600 / 1e12)
    # a run of pointwise ops only (a SwiGLU's silu and mul) streams at the full bandwidth under either Inductor
    swiglu = [g1, mem("silu", [(1, 400)], [(2, 400)]), mem("mul", [(2, 400)], [(3, 200)]), g2]
    assert op_seconds(fuse(swiglu, reduction_share=0.5)[1], DEV) == pytest.approx(600 / 2e12)
    # an fp8 cast's amax (a whole-tensor max) is not a row reduction
    cast = [g1, mem("max", [(1, 400)], [(2, 4)]), mem("_to_copy", [(1, 400), (2, 4)], [(3, 200)]), g2]
    assert fuse(cast, reduction_share=0.5)[1].bandwidth_share == 1.0
    with pytest.raises(ValueError, match=r"reduction_share 0: must be in \(0, 1\]"):
        fuse(ops, reduction_share=0)


def test_a_whole_tensor_reduction_ends_a_compiled_kernel():
    # fp8's tensorwise cast: an add (reads A 400, writes B 400), the amax of B (writes a 2-byte scalar S), the cast of
    # B by S (writes C 200). No element may be cast before the amax has seen every one, so the run is two kernels:
    # add + amax reads A and writes B and S (400 + 400 + 2 = 802 bytes); the cast reads B and S and writes C
    # (400 + 2 + 200 = 602). One kernel would be 400 + 200 = 600
    g1 = replace(gemm(8, 8, 8), writes=((1, 400),))
    g2 = replace(gemm(8, 8, 8), reads=((4, 200),))
    ops = [g1, mem("add", [(1, 400)], [(2, 400)]), mem("max", [(2, 400)], [(3, 2)]),
           mem("_to_copy", [(2, 400), (3, 2)], [(4, 200)]), g2]
    fused = fuse(ops)
    assert [o.kind for o in fused] == [GEMM, MEMORY, MEMORY, GEMM]
    assert [o.bytes for o in fused[1:3]] == [802, 602]
    # a row reduction (a norm's mean writes one value a row, 400 / 4 of them here) does not end the kernel
    norm = [g1, mem("mean", [(1, 400)], [(2, 100)]), mem("mul", [(1, 400), (2, 100)], [(4, 200)]), g2]
    assert [o.bytes for o in fuse(norm) if o.kind == MEMORY] == [600]


def test_compile_fuses_the_blocks_and_leaves_the_ends_eager(llama_tiny):
    # the harness compiles each block's forward (harness.parallel.levers.apply_compile), as torchtitan does: a
    # compiled rank's memory-bound seconds are its blocks' fused kernels plus the ends' eager ones, kernel by kernel
    from harness.model.op_step import rank_passes, trace_spec  # noqa: PLC0415
    from harness.model.op_trace import trace_ends  # noqa: PLC0415
    from harness.model.shape import CellShape  # noqa: PLC0415
    from harness.parallel.presets import degrees_for  # noqa: PLC0415

    c = CellShape(size=llama_tiny, dims=degrees_for("single", 1), strategy="single", precision="bf16",
                  global_batch=2, device_kind="cuda")
    spec = trace_spec(c)
    blocks = [op for layer in range(llama_tiny.n_layers) for op in fuse(list(trace_block(llama_tiny, layer, spec)))]
    ends = list(trace_ends(llama_tiny, spec))
    expected = sum(op_seconds(o, DEV) for o in blocks + ends if o.kind == MEMORY)
    (compiled,) = rank_passes(c, DEV, compile=True)
    assert compiled.seconds[MEMORY] == pytest.approx(expected)
    # and the ends' kernels are as many as eager runs them: compile removes only the blocks' kernels
    (eager,) = rank_passes(c, DEV, compile=False)
    eager_blocks = [op for layer in range(llama_tiny.n_layers) for op in trace_block(llama_tiny, layer, spec)]
    kernels = sum(o.kind in (MEMORY, GEMM, ATTENTION) for o in blocks + ends)
    assert compiled.kernels == kernels < eager.kernels == sum(o.kind in (MEMORY, GEMM, ATTENTION)
                                                             for o in eager_blocks + ends)


def test_tensor_parallel_splits_a_column_linear_by_its_output_and_a_row_linear_by_its_input():
    # attn.q of 4,096 -> 4,096 over 16,384 tokens at tp 4: n 4096 -> 1024 (forward), FLOPs / 4
    col = replace(gemm(16384, 4096, 4096), module="attn.q", features=(4096, 4096))
    assert split_for_tp(col, 4, sp=True).gemm == (1, 16384, 1024, 4096)
    # mlp.proj of 14,336 -> 4,096: its input width 14,336 is the one split: k 14336 -> 3584
    row = replace(gemm(16384, 4096, 14336), module="mlp.proj", features=(14336, 4096))
    assert split_for_tp(row, 4, sp=True).gemm == (1, 16384, 4096, 3584)
    assert split_for_tp(row, 4, sp=True).flops == row.flops / 4
    # a residual add: split by sp (tp 4) only when sequence parallel is on
    add = mem("add", [(1, 400)], [(2, 400)])
    assert split_for_tp(add, 4, sp=True).bytes == 200 and split_for_tp(add, 4, sp=False).bytes == 800


@pytest.fixture(scope="module")
def llama_tiny():
    return replace(get_size("tiny", "llama3"), seq_len=64)


def test_the_traced_block_runs_the_matmuls_the_model_lists(llama_tiny):
    # forward GEMM FLOPs = 2 x tokens x each matmul's k x n (block_ops' list); backward twice that (input and weight)
    spec = TraceSpec(rows=2, seq=64, precision="fp32")
    ops = trace_block(llama_tiny, 0, spec)
    tokens = 2 * 64
    listed = sum(2 * tokens * m.k * m.n for m in block_matmuls(llama_tiny))
    assert sum(o.flops for o in ops if o.kind == GEMM and o.phase == FORWARD) == pytest.approx(listed)
    assert sum(o.flops for o in ops if o.kind == GEMM and o.phase == BACKWARD) == pytest.approx(2 * listed)
    # attention: the FlashAttention papers' count, 4 x seq^2 x head width x heads per row, halved (causal)
    s = llama_tiny
    att = [o for o in ops if o.kind == ATTENTION and o.phase == FORWARD]
    assert len(att) == 1 and att[0].flops == pytest.approx(4 * 2 * 64 * 64 * s.head_dim * s.n_heads / 2)


def test_the_op_policy_recomputes_the_matmuls_it_does_not_keep(llama_tiny):
    # block_ops' "op" rule keeps the 1st, 3rd, ... matmul: the trace's recomputed GEMMs are exactly the others
    ops = trace_block(llama_tiny, 0, TraceSpec(rows=2, seq=64, precision="fp32", recompute="op"))
    matmuls = block_matmuls(llama_tiny)
    dropped = sorted(2 * 128 * m.k * m.n for m, keep in zip(matmuls, kept_by_op(matmuls)) if not keep)
    assert sorted(o.flops for o in ops if o.kind == GEMM and o.phase == RECOMPUTE) == pytest.approx(dropped)
    assert not [o for o in ops if o.kind == ATTENTION and o.phase == RECOMPUTE]  # the attention's output is kept


def test_an_expert_gemm_runs_its_rows_per_expert_and_expert_parallel_gathers_them():
    # 8 experts, top 2, 128 tokens: 256 routed rows, 32 per expert; under ep 4 a rank's 2 experts get 128 each
    size = replace(get_size("tiny", "moe"), seq_len=64)
    size = replace(size, moe=replace(size.moe, n_experts=8, top_k=2, n_shared=0, d_ff=2 * size.d_model))
    assert isinstance(size.moe, MoESpec)
    for ep, rows, experts in ((1, 32, 8), (4, 128, 2)):
        ops = trace_block(size, 0, TraceSpec(rows=2, seq=64, precision="fp32", ep=ep))
        up = [o for o in ops if o.kind == GEMM and o.phase == FORWARD and o.module == "mlp.experts"
              and o.gemm[2] == size.moe.d_ff]
        assert [o.gemm[1] for o in up] == [rows] * (2 * experts)  # gate and up per local expert
        assert sum(o.kind == SYNC for o in ops) == 1  # the routed counts read on the host


def test_every_preset_names_a_source_for_each_rate():
    from harness.model.hardware import DEVICES  # noqa: PLC0415

    for name, dev in DEVICES.items():
        sources = dict(dev.op_rates.sources)
        assert set(sources) == {"gemm_tflops", "attention", "bandwidth_efficiency", "launch_s", "kernel_floor_s"}, name
        assert all(sources.values()), name
        assert math.isfinite(dev.op_rates.bandwidth_efficiency) and 0 < dev.op_rates.bandwidth_efficiency <= 1, name


def test_fp8_without_torchao_casts_each_operand_in_two_passes_compiled():
    # a converted linear's GEMM of 64 rows x 32 from 16 (operands 64 x 16 and 16 x 32 in bf16): each operand's amax
    # reads it (2 x elems) and writes a 4-byte scale; its cast reads it and the scale and writes 1 byte an element.
    # Compiled, the amax ends a kernel, so each operand is two kernels: 2,048 + 4 = 2,052 and 2,048 + 4 + 1,024 =
    # 3,076 bytes (x: 1,024 elements), 1,024 + 4 = 1,028 and 1,024 + 4 + 512 = 1,540 (w: 512); the GEMM at 1 byte.
    # x's cast and w's amax are adjacent and independent: one kernel of 3,076 + 1,028 = 4,104 bytes
    from harness.model.op_step import _with_fp8  # noqa: PLC0415

    mm = replace(gemm(64, 32, 16), module="attn.q", reads=((1, 2 * 64 * 16), (2, 2 * 16 * 32)), writes=((3, 4096),))
    ops = fuse(_with_fp8([mm], frozenset({"attn.q"})))
    assert [(o.name, o.bytes) for o in ops] == [("amax", 2052), ("fused 2", 4104), ("cast_to_fp8", 1540),
                                                ("mm", mm.read // 2 + mm.written)]
    assert ops[-1].dtype == "fp8" and {sid for sid, _ in ops[-1].reads}.isdisjoint({1, 2})  # it reads the casts


@pytest.mark.parametrize("arch,policy,schedule,runs", [
    # by hand: G weight groups in the region (gpt2 full 8: q, k, v, out, fc, proj with their biases, two LayerNorms;
    # llama3 9: q, k, v, out, gate, up, proj, two RMSNorms; moe 10: the router's score and the experts' gate, up and
    # proj tensors for the MLP's three; attn 3: q, k, v); the first stage once, any other 1 + s G, s the stage's
    # split share: zb 1; DualPipeV at pp 2 and 4 microbatches 1/4 (one I/W pair and three full backwards a stage)
    ("gpt2", "full", "zb", [1, 9, 9, 9]), ("gpt2", "attn", "zb", [1, 4, 4, 4]),
    ("llama3", "full", "zb", [1, 10, 10, 10]), ("moe", "full", "zb", [1, 11, 11, 11]),
    ("moe", "attn", "zb", [1, 4, 4, 4]), ("gpt2", "full", "dualpipev", [1, 3, 3, 3]),
    ("llama3", "attn", "dualpipev", [1, 1.75, 1.75, 1.75]),
])
def test_a_split_backward_recomputes_a_block_once_per_pass_that_unpacks_it(arch, policy, schedule, runs):
    """pp 2, 4 microbatches, four stages of one tiny block each (block i on stage i, zb's and dualpipev's alike)."""
    from harness.model.op_step import recomputes, trace_spec  # noqa: PLC0415
    from harness.model.shape import CellShape  # noqa: PLC0415
    from harness.parallel.presets import degrees_for  # noqa: PLC0415

    size = get_size("tiny", arch)
    c = CellShape(size=size, dims=degrees_for("pp", 2), strategy="pp", precision="bf16", global_batch=8,
                  microbatches=4, pp_schedule=schedule, device_kind="cpu", recompute=policy)
    assert [recomputes(c, layer, list(trace_block(size, layer, trace_spec(c)))) for layer in range(4)] == runs
    plain = CellShape(size=size, dims=degrees_for("pp", 2), strategy="pp", precision="bf16", global_batch=8,
                      microbatches=4, pp_schedule="interleaved1f1b", device_kind="cpu", recompute=policy)
    assert [recomputes(plain, layer, []) for layer in range(4)] == [1.0] * 4


SPLIT_REFERENCE = "results/reference/pp-split-recompute-cpu-tiny-w2/records.jsonl.gz"


def test_the_recomputation_counted_on_every_rank_of_the_split_backward_runs_is_the_models():
    """Each pipelined cell of the reference (gpt2, llama3 and moe tiny; zb, zbv and dualpipev; attn and full: 18
    cells, 36 ranks): the matmuls a rank's backward ran beyond twice its forward's, counted, equal the policy's
    recomputation of each of its blocks (what the blocks' forwards ran) times the model's runs of that block."""
    import gzip  # noqa: PLC0415
    import json  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from harness.run.claims import expected_recompute, split_runs  # noqa: PLC0415
    from harness.spec import CellConfig  # noqa: PLC0415

    path = Path(__file__).resolve().parents[2] / SPLIT_REFERENCE
    ranks = 0
    with gzip.open(path, "rt") as f:
        for line in f:
            record = json.loads(line)
            if record["kind"] != "cell" or record["config"]["strategy"] != "pp":
                continue
            cfg = CellConfig.from_record(record["config"])
            runs = split_runs(cfg)
            assert runs is not None and max(runs.values()) > 1, record["cell_id"]
            for t in (r["ops"] for r in record["metrics"]["observed"]["by_rank"]):
                measured = t["backward_matmuls"] - 2 * t["forward_matmuls"]
                assert measured == expected_recompute(cfg.ac, t["blocks"], runs), record["cell_id"]
                ranks += 1
    assert ranks == 36


def test_a_split_backward_prices_each_blocks_recomputation_that_many_times(llama_tiny):
    """zb's rank runs interleaved 1F1B's GEMMs (the same two looped stages per rank) plus its blocks' further
    recomputations: rank 0 holds stage 0 (once) and stage 2 (ten times), rank 1 stages 1 and 3 (ten each); without
    recompute the two are priced alike."""
    from harness.model.op_step import rank_passes  # noqa: PLC0415
    from harness.model.shape import CellShape  # noqa: PLC0415
    from harness.parallel.presets import degrees_for  # noqa: PLC0415

    def gemm_s(schedule: str, recompute: str) -> list[float]:
        c = CellShape(size=llama_tiny, dims=degrees_for("pp", 2), strategy="pp", precision="bf16", global_batch=4,
                      microbatches=4, pp_schedule=schedule, device_kind="cuda", recompute=recompute)
        return [p.seconds[GEMM] for p in rank_passes(c, DEV)]

    assert gemm_s("zb", "none") == pytest.approx(gemm_s("interleaved1f1b", "none"))
    once = [ilv - plain for ilv, plain in zip(gemm_s("interleaved1f1b", "full"), gemm_s("interleaved1f1b", "none"),
                                              strict=True)]  # one recomputation of each rank's two blocks
    extra = [zb - ilv for zb, ilv in zip(gemm_s("zb", "full"), gemm_s("interleaved1f1b", "full"), strict=True)]
    assert all(o > 0 for o in once)
    assert extra == pytest.approx([once[0] / 2 * 9, once[1] * 9])  # rank 0: stage 2's block 9 more; rank 1: both


def test_the_workload_calibrated_pass_of_a_split_backward_rank_runs_its_blocks_recomputation_that_many_times():
    """The CPU's (and ``--efficiency``'s) per-row model: llama3 tiny, zb at pp 2, full recompute. Each rank's pass is
    its share of the model's FLOPs plus its own blocks' recomputation times their runs, at the per-row rate the whole
    model's single recomputation was scaled to. By hand (d 128, 4 heads of 32, seq 128, d_ff 352, 2 kv heads of 32):
    a block's weights 128 x (128 + 64 + 64 + 128) + 3 x 128 x 352 = 184,320; its recomputation 2 x 184,320 + 2 x 256
    x 128 (the attention: scores and values, 4 heads of 32 each way, over 128 keys) - 2 x 352 x 128 (the
    early-stopped output projection) = 344,064 FLOPs per token."""
    from harness.model.compute import ComputeRates, recompute_extra, stage_shares, with_recompute  # noqa: PLC0415
    from harness.model.op_step import block_runs  # noqa: PLC0415
    from harness.model.shape import CellShape  # noqa: PLC0415
    from harness.parallel.presets import degrees_for  # noqa: PLC0415

    c = CellShape(size=get_size("tiny", "llama3"), dims=degrees_for("pp", 2), strategy="pp", precision="fp32",
                  global_batch=8, microbatches=4, pp_schedule="zb", device_kind="cpu", recompute="full")
    assert recompute_extra(c) == [344_064.0] * 4
    runs = block_runs(c)
    assert runs == {0: 1.0, 1: 10.0, 2: 10.0, 3: 10.0}  # zb: rank 0 stages 0 and 2, rank 1 stages 1 and 3
    rates = ComputeRates(alpha_s=0.0, beta_s_per_row=1.0, optimizer_s_per_param=0.0, basis="workload")
    model = c.size.flops_per_token()
    executed = model + 4 * 344_064  # the single recomputation the per-row rate is scaled by
    split = with_recompute(rates, c, runs)
    once = with_recompute(rates, c, dict.fromkeys(range(4), 1.0))
    assert once.stage_pass_s is None and split.beta_s_per_row == once.beta_s_per_row == executed / model
    rows = c.microbatch_rows
    for p, ((share, _), blocks) in enumerate(zip(stage_shares(c), ([0, 2], [1, 3]), strict=True)):
        flops = share * model + sum(344_064 * runs[i] for i in blocks)
        assert split.stage_pass_s[p] == pytest.approx(rows * flops / model)
    assert split.stage_pass_s[1] > split.stage_pass_s[0]  # rank 1's stages both split; rank 0 holds the first
