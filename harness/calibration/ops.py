"""``harness calibrate --ops``: what the op-by-op pricing (:mod:`harness.model.op_cost`) needs, measured on this
device, into the store (kind ``ops``).

* **GEMMs** at the shapes the supported models run (:data:`GPU_GEMMS`: attention and MLP projections of 8B- and
  70B-class blocks over 4k-16k tokens, an MoE expert's width over a few thousand rows), per dtype (fp8 through
  ``torch._scaled_mm`` where the GPU has FP8 tensor cores), as TFLOP/s;
* **flash attention** (SDPA, causal) forward, and forward with backward, at head widths 64 and 128 over sequence
  lengths 1k-16k, as TFLOP/s by the FlashAttention papers' count (``4 x seq^2 x head width x heads``, halved when
  causal; backward 2.5 x forward): the table :class:`harness.model.op_cost.AttentionTable` reads;
* **bandwidth**: a device-to-device copy of 1 GiB, bytes read and written over its time;
* **launch**: the host time of one eager op (a small op on a tensor that requires grad, autograd recording it), the
  GPU kept busy enough that the host is what is timed;
* **kernel floor**: the GPU time of one tiny kernel, replayed from a CUDA graph (no host in the way); 0 on a CPU.

Each measurement is the median of its repeats. A CPU runs a small grid (:data:`CPU_GEMMS`) so the path is tested;
its rates never price a GPU (the entry's fingerprint names the device).
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from harness.calibration import store
from harness.calibration.matmul import device_name, time_windows
from harness.model.hardware import Device

OPS_CALIBRATION_VERSION = 1
GPU_GEMMS = ((16384, 4096, 4096), (16384, 1024, 4096), (16384, 14336, 4096), (16384, 4096, 14336),
             (8192, 8192, 8192), (8192, 28672, 8192), (8192, 8192, 28672), (4096, 2048, 7168), (4096, 7168, 2048),
             (2048, 768, 2048), (2048, 2048, 768))
"""(m, n, k): llama3 8B's q, k/v, MLP up and down over 16k tokens; 70B's square and MLP over 8k; a 2k-wide MoE
expert (DeepSeek-V3's 2048 x 7168) over 4k rows and a 768-wide one (Qwen3-30B-A3B's) over 2k rows."""
CPU_GEMMS = ((256, 256, 256), (512, 128, 256))
@dataclass(frozen=True)
class AttentionPlan:
    seq: tuple[int, ...]
    head_dims: tuple[int, ...]
    tokens: int
    """Tokens per call: the batch is ``tokens / seq``."""
    heads_x_dim: int
    """Heads x head width: the heads are ``heads_x_dim / head width``."""


GPU_ATTENTION = AttentionPlan(seq=(1024, 2048, 4096, 8192, 16384), head_dims=(64, 128), tokens=32768,
                              heads_x_dim=2048)
"""Sequences at a fixed 32k tokens per call, heads x head width 2048 (llama3 1B's attention width)."""
CPU_ATTENTION = AttentionPlan(seq=(128, 256), head_dims=(64,), tokens=512, heads_x_dim=128)


def fingerprint(device_kind: str) -> dict:
    return {"device_kind": device_kind, "device_name": device_name(device_kind), "torch": torch.__version__,
            "version": OPS_CALIBRATION_VERSION}


def lookup(device_kind: str, cache: Path | None = None) -> dict | None:
    return store.get("ops", fingerprint(device_kind), cache)


def stored_for(product: str, cache: Path | None = None) -> dict | None:
    """The newest ops entry measured on a device named ``product`` (any torch), or None."""
    entries = [e for e in store.entries("ops", cache) if e["fingerprint"].get("device_name") == product]
    return max(entries, key=lambda e: e.get("measured_at", ""), default=None)


def with_measured(device: Device, cache: Path | None = None) -> Device:
    """``device`` priced with what ``harness calibrate --ops`` measured on a device of its product, where the store
    holds it (the plan's header then names it as the source of each rate)."""
    entry = stored_for(device.product, cache)
    return device if entry is None else replace(device, measured_ops=entry)


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _seconds(fn: Callable[[], object], cuda: bool, min_time_s: float, repeats: int) -> float:
    """Median seconds per call of ``fn`` over ``repeats`` windows of at least ``min_time_s``."""
    return statistics.median(time_windows(fn, cuda, min_time_s, repeats, max_reps=1 << 14))


def _fp8_ok(cuda: bool) -> bool:
    return cuda and torch.cuda.get_device_capability() >= (8, 9) and hasattr(torch, "_scaled_mm")


def _gemm_call(dtype: str, m: int, n: int, k: int, dev: str) -> Callable[[], object]:
    """One GEMM of the shape in the dtype, ready to time (fp8: ``torch._scaled_mm``, the second operand column-major
    as it takes it, unit scales)."""
    if dtype == "fp8":
        a8 = torch.randn(m, k, device=dev).to(torch.float8_e4m3fn)
        b8 = torch.randn(n, k, device=dev).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=dev)
        return lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    a, b = torch.randn(m, k, device=dev, dtype=tdtype), torch.randn(k, n, device=dev, dtype=tdtype)
    return lambda: a @ b


def measure_gemms(cuda: bool, dtypes: tuple[str, ...], min_time_s: float, repeats: int) -> list[dict]:
    dev = "cuda" if cuda else "cpu"
    out = []
    for dtype in dtypes:
        if dtype == "fp8" and not _fp8_ok(cuda):
            continue
        for m, n, k in GPU_GEMMS if cuda else CPU_GEMMS:
            s = _seconds(_gemm_call(dtype, m, n, k, dev), cuda, min_time_s, repeats)
            out.append({"dtype": dtype, "m": m, "n": n, "k": k, "tflops": 2 * m * n * k / s / 1e12})
    return out


def measure_attention(cuda: bool, min_time_s: float, repeats: int) -> list[dict]:
    """Flash attention (SDPA, causal) forward and forward+backward, TFLOP/s by the FlashAttention papers' count."""
    plan = GPU_ATTENTION if cuda else CPU_ATTENTION
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    out = []
    for head_dim in plan.head_dims:
        heads = max(1, plan.heads_x_dim // head_dim)
        for seq in plan.seq:
            batch = max(1, plan.tokens // seq)
            q, k, v = (torch.randn(batch, heads, seq, head_dim, device=dev, dtype=dtype, requires_grad=True)
                       for _ in range(3))
            fwd_flops = 4 * batch * seq * seq * head_dim * heads / 2

            def fwd(q=q, k=k, v=v):
                with torch.no_grad():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

            def fwd_bwd(q=q, k=k, v=v):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                y.backward(torch.ones_like(y))

            out.append({"head_dim": head_dim, "seq": seq,
                        "fwd_tflops": fwd_flops / _seconds(fwd, cuda, min_time_s, repeats) / 1e12,
                        "fwd_bwd_tflops": 3.5 * fwd_flops / _seconds(fwd_bwd, cuda, min_time_s, repeats) / 1e12})
    return out


def measure_bandwidth(cuda: bool, min_time_s: float, repeats: int) -> float:
    """GB/s of a device-to-device copy: 2 x its bytes (one read, one write) over its time."""
    dev = "cuda" if cuda else "cpu"
    n = (1 << 30 if cuda else 1 << 26) // 4
    src, dst = torch.empty(n, device=dev), torch.empty(n, device=dev)
    return 2 * 4 * n / _seconds(lambda: dst.copy_(src), cuda, min_time_s, repeats) / 1e9


def measure_launch(cuda: bool, ops: int = 2000) -> float:
    """Host seconds per eager op: ``ops`` small multiplications autograd records, timed on the host alone (the GPU
    runs each in far less than the host takes to launch it)."""
    dev = "cuda" if cuda else "cpu"
    x = torch.ones(16, device=dev, requires_grad=True)
    for _ in range(100):  # warm the dispatcher and the allocator
        x * 2.0
    _sync(cuda)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(ops):
            x * 2.0
        times.append((time.perf_counter() - t0) / ops)
        _sync(cuda)
    return statistics.median(times)


def measure_floor(cuda: bool, kernels: int = 1000) -> float:
    """GPU seconds per tiny kernel: ``kernels`` of them captured in a CUDA graph and replayed; 0 on a CPU."""
    if not cuda:
        return 0.0
    x = torch.ones(16, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            x.mul_(1.0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(kernels):
            x.mul_(1.0)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / kernels)
    return statistics.median(times)


def measure(device_kind: str, min_time_s: float = 0.05, repeats: int = 3) -> dict:
    cuda = device_kind == "cuda"
    dtypes = ("bf16", "fp8", "fp32") if cuda else ("fp32",)
    return {"gemms": measure_gemms(cuda, dtypes, min_time_s, repeats),
            "attention": measure_attention(cuda, min_time_s, repeats),
            "bandwidth_gbps": measure_bandwidth(cuda, min_time_s, repeats),
            "launch_s": measure_launch(cuda), "kernel_floor_s": measure_floor(cuda),
            "measured_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S%z")}


def calibrate(device_kind: str, force: bool = False, cache: Path | None = None, min_time_s: float = 0.05) -> dict:
    """The stored entry for this device, or a new measurement stored."""
    fp = fingerprint(device_kind)
    if not force and (e := store.get("ops", fp, cache)) is not None:
        return e
    return store.put("ops", fp, measure(device_kind, min_time_s), cache)
