"""What the ``single`` cell costs beyond a plain training loop, part by part, measured side by side.

    .venv/bin/python scripts/harness_cost.py --rounds 6 --out results/reference/harness-cost

Every side is a fresh process timing the same span, one training step (zero_grad, forward, loss,
backward, AdamW step; the batch is made before the clock starts, on both sides), of the same
model (tiny, seq 128, batch 8), data and thread count; the sides run once per round, the order
rotated each round, and each side's number in a round is its median step. Sides:

- ``bare``: ``tests/bench/bare_loop.py``, the project's GPT in the plainest loop;
- ``cell``: ``harness bench`` of the ``single`` cell as a user runs it (fork server, NVTX ranges,
  host monitor thread, heartbeat, loss read back each step);
- ``cell-nvtx-off``, ``cell-monitor-off``, ``cell-torchrun``: the cell with one part changed
  (``--nvtx off``, ``--monitor-hz 0``, ``--launcher torchrun``): the part's cost is its ratio to ``cell``;
- ``plain-fused-qkv``: an independent GPT-2 written here, as such loops usually are (one fused
  q/k/v projection instead of the workload's three, which tensor parallelism shards separately);
  how much of a gap against a loop written outside the project is the model's layout, not the harness;
- ``here``: the bare loop in this long-lived process (not a fresh one);
- ``cell-base`` (with ``--base-tree DIR``): the cell as another checkout of the project runs it (the code before
  a change, say ``git worktree add DIR HEAD~1``), side by side with this one's in the same rounds.

``--device cuda`` runs the cell and the bare loops (``bare``, ``here``) as ``small`` in bf16 on one GPU, each bare step
timed by the harness's CUDA events (issue 62's GPU check, in scripts/gpu_checks.sh). ``--sides`` picks some of
them (``bare`` and ``cell`` always run: the ratios are to them), e.g. for issue 62::

    .venv/bin/python scripts/harness_cost.py --rounds 12 --sides bare,here,cell,cell-base \
        --base-tree /tmp/before --out results/reference/harness-cost/issue62

Prints, and writes to OUT/cost.md and OUT/rounds.json, each side's median over rounds and the
median of its per-round ratio to ``bare`` (and to ``cell``) with a bootstrap 95% interval.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from harness.spec import threads_per_rank
from workloads.data import MarkovData
from workloads.sizes import get_size

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the bare loop of tests/bench, run in this process for the side `here`
from tests.bench.bare_loop import median_step_s  # noqa: E402

STEPS, WARMUP, SIZE, SEQ, BATCH = 30, 3, "tiny", 128, 8
GPU = {"device": "cuda", "size": "small", "precision": "bf16"}
"""``--device cuda``: the cell and the bare loops run ``small`` in bf16 on one GPU, each step timed by CUDA events."""


def cell_args(device: str) -> list[str]:
    """``harness bench`` of the ``single`` cell, as the sides run it on ``device``."""
    size, precision = (GPU["size"], GPU["precision"]) if device == "cuda" else (SIZE, "fp32")
    return ["-m", "harness", "bench", "--device", device, "--gpus", "1", "--sizes", size, "--strategies", "single",
            "--precision", precision, "--seq-len", str(SEQ), "--batch", str(BATCH), "--steps", str(STEPS),
            "--warmup", str(WARMUP), "--no-calibrate"]


def bare_args(device: str) -> list[str]:
    """The bare loop's arguments after ``STEPS WARMUP THREADS`` (``tests/bench/bare_loop.py``)."""
    return [device, GPU["size"], GPU["precision"]] if device == "cuda" else []


SIDES = {
    "bare": None,
    "cell": [],
    "cell-nvtx-off": ["--nvtx", "off"],
    "cell-monitor-off": ["--monitor-hz", "0"],
    "cell-torchrun": ["--launcher", "torchrun"],
    "plain-fused-qkv": None,
    "here": None,
    "cell-base": [],
}


def _cell_median(out: Path, extra: list[str], device: str, tree: Path = REPO) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree)} if tree != REPO else None
    res = subprocess.run([sys.executable, *cell_args(device), *extra, "--out", str(out)], cwd=tree, capture_output=True,
                         text=True, timeout=600, check=False, env=env)
    if res.returncode != 0:
        raise SystemExit(f"harness bench {' '.join(extra)} exited {res.returncode}: {res.stderr[-2000:]}")
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    (cell,) = [r for r in records if r.get("kind") == "cell"]
    return float(cell["metrics"]["step_time_s"]["median"])


def _cell_side(runs: Path, name: str, extra: list[str], device: str, r: int) -> float:
    return _cell_median(runs / f"{name}-r{r}", extra, device)


def _child_median(args: list[str]) -> float:
    res = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(args)} exited {res.returncode}: {res.stderr[-2000:]}")
    return float(json.loads(res.stdout.strip().splitlines()[-1]))


def plain_fused_qkv(threads: int) -> float:
    """An independent GPT-2 loop (fused q/k/v), timed like the bare loop: median step seconds."""
    torch.set_num_threads(threads)
    size = replace(get_size(SIZE), seq_len=SEQ)
    d, h = size.d_model, size.d_model // size.head_dim

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.out = nn.Linear(d, size.d_ff), nn.Linear(size.d_ff, d)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
            x = x + self.proj(y)
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(size.vocab_size, d), nn.Embedding(SEQ, d)
            self.blocks = nn.Sequential(*[Block() for _ in range(size.n_layers)])
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, size.vocab_size, bias=False)

        def forward(self, idx):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            return self.head(self.ln(self.blocks(x)))

    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    data = MarkovData(size.vocab_size, SEQ, seed=0)
    times = []
    for step in range(WARMUP + STEPS):
        x, y = data.batch(step, BATCH)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x).reshape(-1, size.vocab_size), y.reshape(-1)).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[WARMUP:])


def ratio_ci(base: list[float], other: list[float], seed: int = 0) -> tuple[float, float, float]:
    """Median of the per-round ratios ``base_i / other_i`` (> 1: ``other`` is faster) and its bootstrap 95% CI."""
    r = np.asarray(base) / np.asarray(other)
    boot = np.median(r[np.random.default_rng(seed).integers(0, len(r), size=(4000, len(r)))], axis=1)
    lo, hi = np.quantile(boot, [0.025, 0.975])
    return float(np.median(r)), float(lo), float(hi)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--sides", default=",".join(s for s in SIDES if s not in ("here", "cell-base")),
                   help=f"comma-separated, of {', '.join(SIDES)} (bare and cell always run)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: small bf16 on one GPU (the bare loops timed by CUDA events); plain-fused-qkv is CPU's")
    p.add_argument("--base-tree", type=Path, help="another checkout of the project: its cell is the side cell-base")
    p.add_argument("--plain-fused-qkv", type=int, metavar="THREADS", help=argparse.SUPPRESS)  # the child side
    args = p.parse_args()
    if args.plain_fused_qkv is not None:
        print(json.dumps(plain_fused_qkv(args.plain_fused_qkv)))
        return
    if args.out.exists():
        raise SystemExit(f"--out {args.out} exists; choose a new directory (nothing measured is overwritten)")
    names = ["bare", "cell", *[n for n in args.sides.split(",") if n not in ("bare", "cell")]]
    unknown = [n for n in names if n not in SIDES]
    if unknown:
        raise SystemExit(f"--sides {args.sides}: unknown side(s) {', '.join(unknown)}; choose from {', '.join(SIDES)}")
    if args.device == "cuda" and "plain-fused-qkv" in names:
        raise SystemExit("--device cuda: the side plain-fused-qkv runs on CPU only; leave it out of --sides")
    if ("cell-base" in names) != (args.base_tree is not None):
        raise SystemExit("--sides cell-base and --base-tree DIR go together: the side is that checkout's cell")
    threads = threads_per_rank(1)
    torch.set_num_threads(threads)
    runs = args.out / "runs"
    runs.mkdir(parents=True)
    measure: dict[str, Callable[[int], float]] = {
        "here": lambda r: median_step_s(STEPS, WARMUP, *bare_args(args.device)),
        "cell-base": lambda r: _cell_median(runs / f"cell-base-r{r}", [], args.device, args.base_tree),
        "bare": lambda r: _child_median(["-m", "tests.bench.bare_loop", str(STEPS), str(WARMUP), str(threads),
                                         *bare_args(args.device)]),
        "plain-fused-qkv": lambda r: _child_median([str(Path(__file__)), "--out", str(args.out),
                                                    "--plain-fused-qkv", str(threads)]),
    }
    for name, extra in SIDES.items():
        if extra is not None and name != "cell-base":
            measure[name] = partial(_cell_side, runs, name, extra, args.device)
    median_step_s(2, 1, *bare_args(args.device))  # this process's warmup for the side `here` (imports, allocator)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name].append(measure[name](r))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {samples[n][-1] * 1e3:.1f} ms" for n in names),
              flush=True)
    rows = ["| side | median step ms | bare / side (95% CI) | cell / side (95% CI) |", "|---|---|---|---|"]
    for n in names:
        b = ratio_ci(samples["bare"], samples[n])
        c = ratio_ci(samples["cell"], samples[n])
        rows.append(f"| {n} | {statistics.median(samples[n]) * 1e3:.2f} | {b[0]:.3f} [{b[1]:.3f}, {b[2]:.3f}] "
                    f"| {c[0]:.3f} [{c[1]:.3f}, {c[2]:.3f}] |")
    text = (f"{args.rounds} rounds, {STEPS} measured steps a side a round (tiny, seq {SEQ}, batch {BATCH}, "
            f"{threads} threads), order rotated each round; the batch is made before the clock starts on every "
            f"side. bare / side > 1: the side is faster than the bare loop; cell / side > 1: changing that part "
            f"makes the cell faster (the part's cost).\n\n" + "\n".join(rows) + "\n")
    print(text)
    (args.out / "cost.md").write_text(text)
    (args.out / "rounds.json").write_text(json.dumps({"threads": threads, "base_tree": str(args.base_tree or ""),
                                                      "samples_s": samples}, indent=1) + "\n")


if __name__ == "__main__":
    main()
