"""How much this machine's speed drifts: one fixed workload timed in windows, nothing else changed.

    .venv/bin/python scripts/machine_drift.py --seconds 150 --size tiny --threads 2

Times a forward+backward of SIZE at 8 sequences over and over for SECONDS, and prints the
median of each window of WINDOW passes, then the slowest window's median over the fastest's.
On a quiet machine the ratio stays near 1; where it does not, a step time measured in one
minute cannot be held to a prediction calibrated in another at better than that ratio (the
README's "Performance model" section quotes it for this 2-core CPU).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from workloads.model import Decoder, lm_loss
from workloads.sizes import get_size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=150.0)
    p.add_argument("--size", default="tiny")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--window", type=int, default=15, help="passes per window (one median each)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    size = get_size(args.size)
    model = Decoder(size)
    x = torch.randint(0, size.vocab_size, (8, size.seq_len))

    def fb() -> None:
        lm_loss(model(x), x).backward()

    fb()
    medians = []
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        times = []
        for _ in range(args.window):
            t0 = time.perf_counter()
            fb()
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times) * 1e3)
    print(f"{args.size} forward+backward, 8 sequences, {args.threads} threads: median ms per window of "
          f"{args.window} passes, {len(medians)} windows over {args.seconds:.0f} s")
    print(" ".join(f"{m:.0f}" for m in medians))
    print(f"fastest window {min(medians):.1f} ms, slowest {max(medians):.1f} ms: ratio {max(medians) / min(medians):.2f}; "
          f"median of windows {statistics.median(medians):.1f} ms")


if __name__ == "__main__":
    main()
