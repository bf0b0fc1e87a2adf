"""Context parallel's chunk attention both ways on one device: what each costs in memory and time, and its parity.

    python3 scripts/cp_chunk_attention.py --device cuda --out OUTDIR          # the GPU check (scripts/gpu_checks.sh)
    .venv/bin/python scripts/cp_chunk_attention.py --device cpu --chunk 64 --keys 256 --heads 4 --kv-heads 2

One rank's tail chunk at cp 4 by default: ``--chunk`` queries, the last of ``--keys`` positions (4,096 of 32,768 on a
GPU, Llama 3 8B's 32 query and 8 kv heads of width 128, bf16), forward and backward, through
:func:`harness.parallel.cp.chunk_attention` with the lower-right causal bias (the GPU's way) and with the reversed
additive view (the CPU's way). For each: the largest tensor the allocator held beyond the inputs (CUDA's peak
allocated), the median of ``--repeats`` timed passes, and the largest difference from torch's causal attention over
all ``--keys`` positions, last ``--chunk`` rows. Writes OUTDIR/cp-chunk-attention.md when ``--out`` is given.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness.parallel.cp import chunk_attention  # noqa: E402
from harness.records.atomic import write_text_atomic  # noqa: E402

GIB = 2**30


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pass(q, k, v, gqa: bool, lower_right: bool) -> torch.Tensor:
    out = chunk_attention(q, k, v, gqa, lower_right=lower_right)
    out.float().sum().backward()
    return out.detach()


def measure(device: torch.device, chunk: int, keys: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype,
            repeats: int) -> list[dict]:
    """Each way's extra peak (GiB, CUDA only), median seconds and max |difference| from the reference."""
    g = torch.Generator(device=device).manual_seed(0)
    q_all = torch.randn(1, heads, keys, dim, device=device, dtype=dtype, generator=g)
    k = torch.randn(1, kv_heads, keys, dim, device=device, dtype=dtype, generator=g).requires_grad_()
    v = torch.randn(1, kv_heads, keys, dim, device=device, dtype=dtype, generator=g).requires_grad_()
    gqa = kv_heads != heads
    with torch.no_grad():
        ref = F.scaled_dot_product_attention(q_all, k, v, is_causal=True, enable_gqa=gqa)[:, :, keys - chunk:]
    q = q_all[:, :, keys - chunk:].clone().requires_grad_()
    rows: list[dict] = []
    for lower_right in (True, False):
        _sync(device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        way = "lower-right causal bias (GPU)" if lower_right else "reversed additive view (CPU)"
        try:
            out = _pass(q, k, v, gqa, lower_right)
            _sync(device)
        except torch.OutOfMemoryError as e:  # the way's own result: an additive mask may pick a kernel that keeps more
            q.grad = k.grad = v.grad = None
            rows.append({"way": way, "extra_peak_gib": None, "median_s": None, "max_abs_diff": None,
                         "error": f"out of memory: {str(e).splitlines()[0]}"})
            continue
        extra = (torch.cuda.max_memory_allocated(device) - base) / GIB if device.type == "cuda" else None
        times = []
        for _ in range(repeats):
            q.grad = k.grad = v.grad = None
            _sync(device)
            t0 = time.perf_counter()
            _pass(q, k, v, gqa, lower_right)
            _sync(device)
            times.append(time.perf_counter() - t0)
        rows.append({"way": way, "extra_peak_gib": extra, "median_s": statistics.median(times),
                     "max_abs_diff": (out.float() - ref.float()).abs().max().item()})
    return rows


def render(rows: list[dict], args: argparse.Namespace, device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    lines = [f"# Context parallel's chunk attention, both ways ({name}, torch {torch.__version__})", "",
             f"`python3 scripts/cp_chunk_attention.py --device {args.device} --chunk {args.chunk} --keys {args.keys} "
             f"--heads {args.heads} --kv-heads {args.kv_heads} --dim {args.dim} --dtype {args.dtype}`", "",
             "| way | extra peak GiB | median s (fwd+bwd) | max abs diff from causal SDPA |", "|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['way']} | {r['error']} | - | - |")
            continue
        peak = "n/a: no CUDA allocator" if r["extra_peak_gib"] is None else f"{r['extra_peak_gib']:.3f}"
        lines.append(f"| {r['way']} | {peak} | {r['median_s']:.4f} | {r['max_abs_diff']:.2e} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--keys", type=int, default=32768)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("n/a: no CUDA device on this machine (run with --device cpu at a small size)", file=sys.stderr)
        return 2
    if not 0 < args.chunk <= args.keys:
        print(f"--chunk {args.chunk} must be in 1..--keys ({args.keys})", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    text = render(measure(device, args.chunk, args.keys, args.heads, args.kv_heads, args.dim, dtype, args.repeats),
                  args, device)
    print(text, end="")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(args.out / "cp-chunk-attention.md", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
