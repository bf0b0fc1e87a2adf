"""A rank's compute priced op by op on a device: each traced kernel (:mod:`harness.model.op_trace`) at its own rate.

* **GEMM**: ``max(FLOPs / (achievable rate x wave efficiency), bytes / bandwidth)``. The achievable rate is the
  device's measured dense matmul throughput in the op's dtype at large shapes (:class:`OpRates`); the wave
  efficiency is what a shape leaves of it: its output tiles spread over the SMs in waves, and a last wave that
  fills only part of them idles the rest (NVIDIA's "Matrix Multiplication Background" guide, tile and wave
  quantization): ``tiles / (ceil(tiles / SMs) x SMs)``. An MoE expert's GEMM (a few thousand rows, width 768)
  loses here what a large dense GEMM does not.
* **Attention** (flash attention): its FLOPs (the kernel's, causal half) at the device's measured fraction of the
  dtype's peak, forward and backward apart.
* **Everything else** (norms, activations, RoPE, residual adds, casts, softmax, the loss, the optimizer) is bound by
  the bytes it reads and writes, at the device's achievable fraction of its HBM bandwidth.
* Each kernel costs at least :attr:`OpRates.kernel_floor_s` on the GPU, and eager PyTorch spends
  :attr:`OpRates.launch_s` of host time launching it; a pass takes the longer of the two sums (the host runs
  ahead of the GPU until the GPU's queue drains).

**Compile as fusion**: under ``torch.compile`` each run of memory-bound kernels between two GEMMs or attentions
becomes one kernel that reads what the run reads from outside it and writes what is read after it (by a later op,
forward or backward, or saved for the backward: the trace holds both), its intermediates never written to memory
(Inductor's pointwise and reduction fusion). GEMMs and attention stay as they are. A reduction of a whole tensor
to a scalar (fp8's tensorwise amax) ends a kernel: nothing may use the scalar before every block of the reduction
is done, so the ops after it are a kernel of their own that reads again what they need. A fused kernel with a row
reduction in it (a norm, a softmax, the loss: :data:`REDUCTIONS`) runs at ``reduction_share`` of the streaming
bandwidth: 1 on a torch whose Inductor generates them at the speed of light (its mix-order reductions, on by default
in torch 2.13), 0.5 for the torch of 2024 (PyTorch's "SOTA Normalization Performance with torch.compile": before
that work torch.compile's norm kernels ran at about 50% of Quack's, whose kernels reach the bandwidth a streaming
copy does). Only the blocks are compiled (:func:`harness.parallel.levers.apply_compile`, as torchtitan does): the
ends (embedding, final norm, LM head, loss) run eager.

**Tensor parallel** splits each traced op as its module is split (:mod:`harness.parallel.tp_plan`): a column
linear's output width, a row linear's input width, the heads of attention and everything between the two linears
by ``tp``; the norms and residual adds by ``tp`` under sequence parallel, else whole; the low-rank projections of
MLA, a router and an MoE's experts (split by expert parallel in the trace) whole.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from harness.model.op_record import ATTENTION, BACKWARD, FORWARD, GEMM, HOST, MEMORY, RECOMPUTE, SYNC, Op
from harness.parallel.tp_plan import COLUMN_LINEARS, ROW_LINEARS

KINDS = (GEMM, ATTENTION, MEMORY)
REDUCTIONS = frozenset({"mean", "sum", "var_mean", "rms_norm", "rms_norm_backward", "_fused_rms_norm",
                        "_fused_rms_norm_backward", "native_layer_norm", "native_layer_norm_backward", "_softmax",
                        "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data", "nll_loss_forward",
                        "nll_loss_backward"})
"""The traced ops that reduce along a row (norms, softmax, the loss): a compiled kernel holding one is a reduction
kernel (:func:`fuse`). An fp8 cast's amax (a whole-tensor ``max``) is not one of them."""
SCALAR_BYTES = 8
"""An op that reads a tensor and writes at most this many bytes reduced the whole tensor to a scalar (fp8's amax): a
compiled kernel ends there, since nothing may use the scalar until every block of the reduction is done."""


@dataclass(frozen=True)
class AttentionTable:
    """Flash attention's measured TFLOP/s (the FlashAttention papers' FLOP count: the causal half, backward 2.5 x
    forward) by sequence length and head width, on a part of dense peak :attr:`peak`."""

    peak: float
    seq: tuple[int, ...]
    fwd: tuple[tuple[int, tuple[float, ...]], ...] = ()
    """(head width, TFLOP/s at each :attr:`seq`) of the forward, where measured apart."""
    fwd_bwd: tuple[tuple[int, tuple[float, ...]], ...] = ()
    """(head width, TFLOP/s at each :attr:`seq`) of forward and backward together."""
    source: str = ""

    def fraction(self, backward: bool, head_dim: int, seq: int) -> float:
        """The fraction of :attr:`peak` a pass runs at: interpolated in log(seq) between the measured lengths
        (held at the ends), at the measured head width nearest ``head_dim``. A backward is what forward+backward
        leaves after the forward (``2.5 / (3.5 / fwd_bwd - 1 / fwd)``); without a forward measured apart, both
        run at the forward+backward rate."""
        fwd, both = dict(self.fwd), dict(self.fwd_bwd)
        width = min(both or fwd, key=lambda w: (abs(w - head_dim), w))
        f_row = fwd.get(width)
        b_row = both.get(width, f_row)
        assert b_row is not None
        if not backward:
            row = f_row if f_row is not None else b_row
        elif f_row is None:
            row = b_row
        else:
            row = tuple(2.5 / (3.5 / fb - 1 / f) for f, fb in zip(f_row, b_row, strict=True))
        return _log_interp(self.seq, row, seq) / self.peak


def _log_interp(xs: tuple[int, ...], ys: tuple[float, ...], x: float) -> float:
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = next(j for j in range(1, len(xs)) if xs[j] >= x)
    t = (math.log(x) - math.log(xs[i - 1])) / (math.log(xs[i]) - math.log(xs[i - 1]))
    return ys[i - 1] + t * (ys[i] - ys[i - 1])


@dataclass(frozen=True)
class OpRates:
    """What a device runs each kind of op at, each figure with its source (:attr:`sources`;
    :mod:`harness.model.device_rates` builds a preset's from harness/model/device_rates.toml)."""

    gemm_tflops: tuple[tuple[str, float], ...]
    """Achievable dense matmul TFLOP/s by dtype at large shapes (measured, not the datasheet's)."""
    sms: int
    """Streaming multiprocessors (compute units): the width of one wave of GEMM tiles."""
    attention: AttentionTable
    bandwidth_efficiency: float
    """Achievable fraction of the datasheet HBM bandwidth for a streaming kernel."""
    launch_s: float
    """Host time eager PyTorch spends per op it dispatches (dispatch, autograd bookkeeping, the launch)."""
    kernel_floor_s: float = 0.0
    """The least GPU time a kernel takes (launch latency, a wave's ramp and tail): 0 unless measured."""
    tile: tuple[int, int] = (128, 128)
    """A GEMM kernel's output tile (rows, columns)."""
    sources: tuple[tuple[str, str], ...] = ()
    """(field, where its value comes from, or what stands in for it)."""

    def gemm(self, dtype: str) -> float:
        rates = dict(self.gemm_tflops)
        if dtype not in rates:
            raise ValueError(f"no achievable matmul rate for {dtype} (have {', '.join(rates)})")
        return rates[dtype]


@dataclass(frozen=True)
class Device:
    """What pricing needs of a device: its rates, its dense peaks by dtype and its bandwidth, already scaled for a
    power cap (:attr:`compute_scale`)."""

    rates: OpRates
    peak_tflops: dict[str, float]
    hbm_gbps: float
    compute_scale: float = 1.0


@dataclass
class PassCost:
    """One pass (or several added up): its GPU seconds by kind of kernel, the kernels, and the pass's time as the
    host and the GPU run it together (:func:`price`)."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    kernels: int = 0
    floor_s: float = 0.0
    total_s: float = 0.0
    """The pass from its first launch to the GPU's last kernel's end."""

    @property
    def gpu_s(self) -> float:
        """What the GPU computes: the kernels at their rates and floors."""
        return sum(self.seconds.values()) + self.floor_s

    @property
    def host_bound_s(self) -> float:
        """What the GPU waits for the host (launches, syncs): the pass's time beyond its kernels."""
        return max(0.0, self.total_s - self.gpu_s)

    def add(self, other: PassCost, times: float = 1.0) -> None:
        for k, v in other.seconds.items():
            self.seconds[k] = self.seconds.get(k, 0.0) + v * times
        self.kernels += int(other.kernels * times)
        self.floor_s += other.floor_s * times
        self.total_s += other.total_s * times


def wave_efficiency(op: Op, rates: OpRates) -> float:
    """What a GEMM's shape leaves of the achievable rate: its tiles over the SMs in whole waves."""
    batch, m, n, _ = op.gemm
    tiles = batch * math.ceil(m / rates.tile[0]) * math.ceil(n / rates.tile[1])
    return tiles / (math.ceil(tiles / rates.sms) * rates.sms)


def op_seconds(op: Op, dev: Device) -> float:
    """One kernel's GPU time, without the per-kernel floor (:class:`PassCost` adds it)."""
    bw = dev.hbm_gbps * 1e9 * dev.rates.bandwidth_efficiency
    memory = op.bytes / (bw * op.bandwidth_share)
    if op.kind == GEMM:
        rate = dev.rates.gemm(op.dtype) * 1e12 * dev.compute_scale * wave_efficiency(op, dev.rates)
        return max(op.flops / rate, memory)
    if op.kind == ATTENTION:
        bh, tq, tk, e_qk, e_v = op.attn
        share = dev.rates.attention.fraction(op.phase == BACKWARD, max(e_qk, e_v), tk)
        rate = dev.peak_tflops[op.dtype] * 1e12 * dev.compute_scale * share
        return max(op.flops / rate, memory)
    return memory


def price(ops: Iterable[Op], dev: Device) -> PassCost:
    """The ops in their order as eager PyTorch runs them: the host launches each (:attr:`OpRates.launch_s` per op it
    dispatches, a view's too), the GPU runs each kernel once it is launched and the one before has ended, and a sync
    makes the host wait for the GPU. A pass of large kernels is the GPU's time; a pass of small ones the host's."""
    cost = PassCost()
    host = gpu = 0.0
    floor, launch = dev.rates.kernel_floor_s, dev.rates.launch_s
    for op in ops:
        if op.kind == SYNC:
            host = max(host, gpu)
            continue
        host += launch
        if op.kind == HOST:
            continue
        t = op_seconds(op, dev)
        cost.seconds[op.kind] += t
        cost.kernels += 1
        gpu = max(gpu, host) + t + floor
    cost.floor_s = cost.kernels * floor
    cost.total_s = max(host, gpu)
    return cost


def fuse(ops: list[Op], reduction_share: float = 1.0) -> list[Op]:
    """The ops as ``torch.compile`` runs them (the module docstring): each run of memory-bound ops between two
    GEMMs or attentions, in one phase, becomes one op reading what the run reads from outside it and writing what
    it writes that an op outside it reads, or that no traced op reads (the pass's outputs: the block's output, the
    gradients); a tensor read only inside the run is never written. A run holding a row reduction
    (:data:`REDUCTIONS`) runs at ``reduction_share`` of the bandwidth."""
    if not 0 < reduction_share <= 1:
        raise ValueError(f"reduction_share {reduction_share}: must be in (0, 1], a share of the bandwidth")
    readers: dict[int, set[int]] = {}
    for i, op in enumerate(ops):
        for sid, _ in op.reads:
            readers.setdefault(sid, set()).add(i)
    out: list[Op] = []
    run: list[int] = []

    def close() -> None:
        if not run:
            return
        inside = set(run)
        made: set[int] = set()
        read = 0
        for i in run:
            read += sum(nbytes for sid, nbytes in ops[i].reads if sid not in made)
            made.update(sid for sid, _ in ops[i].reads)
            made.update(sid for sid, _ in ops[i].writes)
        writes: dict[int, int] = {}
        for i in run:
            for sid, nbytes in ops[i].writes:
                writes[sid] = max(writes.get(sid, 0), nbytes)
        written = sum(nbytes for sid, nbytes in writes.items() if sid not in readers or readers[sid] - inside)
        first = ops[run[0]]
        share = reduction_share if any(ops[i].name in REDUCTIONS for i in run) else 1.0
        out.append(replace(first, name=f"fused {len(run)}" if len(run) > 1 else first.name, read=read,
                           written=written, bandwidth_share=share))
        run.clear()

    for i, op in enumerate(ops):
        if op.kind == HOST:  # a compiled graph runs no views
            continue
        if op.kind != MEMORY or (run and ops[run[-1]].phase != op.phase):
            close()
        if op.kind == MEMORY:
            run.append(i)
            if op.written <= SCALAR_BYTES < op.read:  # a whole-tensor reduction: what uses it is a kernel after
                close()
        else:
            out.append(op)
    close()
    return out


def _sharded_width(op: Op) -> str:
    """How tensor parallel splits the module an op belongs to: ``column`` or ``row`` (a linear), ``seq`` (the
    residual stream: by sp), ``whole`` (replicated), ``heads`` (inside attention or the MLP: by tp)."""
    module = op.module
    block = module.split(".")[0]
    if module in COLUMN_LINEARS or module == "head":
        return "column"
    if module in ROW_LINEARS:
        return "row"
    if block in ("", "ln1", "ln2", "norm"):
        return "seq"
    whole = ("attn.q_a", "attn.q_a_norm", "attn.kv_a", "attn.kv_a_norm", "mlp.router", "mlp.experts")
    if any(module == w or module.startswith(w + ".") for w in whole):
        return "whole"
    return "heads"


def split_for_tp(op: Op, tp: int, sp: bool, moe_layer: bool = False) -> Op:
    """``op`` as one of ``tp`` tensor-parallel ranks runs it (the module docstring)."""
    if tp == 1:
        return op
    how = _sharded_width(op)
    if moe_layer and how == "heads" and op.module.startswith("mlp") and not op.module.startswith("mlp.shared"):
        how = "whole"  # the routed layer's dispatch and combine: experts are split by expert parallel, not tp
    if how == "whole" or (how == "seq" and not sp):
        return op
    shrunk = _scaled(op, 1 / tp)
    if op.kind == GEMM and how in ("column", "row"):
        width = op.features[1] if how == "column" else op.features[0]
        batch, m, n, k = op.gemm
        dims = [m, n, k]
        if width in dims:  # the one dimension of the three the split width is
            dims[dims.index(width)] = max(1, width // tp)
        return replace(shrunk, flops=op.flops / tp, gemm=(batch, dims[0], dims[1], dims[2]))
    if op.kind == ATTENTION:
        bh, tq, tk, e_qk, e_v = op.attn
        return replace(shrunk, flops=op.flops / tp, attn=(max(1, bh // tp), tq, tk, e_qk, e_v))
    return shrunk


def _scaled(op: Op, f: float) -> Op:
    """``op`` with every tensor it reads and writes ``f`` times as large (a GEMM's unsplit operand is counted
    split too: a bound on its bytes, which only a small GEMM's time depends on)."""
    return replace(op, read=int(op.read * f), written=int(op.written * f),
                   reads=tuple((sid, int(b * f)) for sid, b in op.reads),
                   writes=tuple((sid, int(b * f)) for sid, b in op.writes))


PHASES = (FORWARD, BACKWARD, RECOMPUTE)
