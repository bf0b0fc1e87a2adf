"""The ``single`` cell's training as plainly as it can be written: same model, data, batch and threads.

``python -m tests.bench.bare_loop STEPS WARMUP THREADS`` prints the median step time (s) of a
fresh process; :func:`median_step_s` runs the same loop in the calling process.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import replace

import torch

from tests.bench.conftest import bare_step
from workloads.data import MarkovData
from workloads.model import Decoder
from workloads.sizes import get_size

SIZE, SEQ_LEN, BATCH = "tiny", 128, 8


def median_step_s(steps: int, warmup: int) -> float:
    size = replace(get_size(SIZE), seq_len=SEQ_LEN)
    torch.manual_seed(0)
    model = Decoder(size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    data = MarkovData(size.vocab_size, SEQ_LEN, seed=0)
    times = []
    for step in range(warmup + steps):
        x, y = data.batch(step, BATCH)
        t0 = time.perf_counter()
        bare_step(model, opt, x, y)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:])


if __name__ == "__main__":
    steps, warmup, threads = (int(a) for a in sys.argv[1:4])
    torch.set_num_threads(threads)
    print(json.dumps(median_step_s(steps, warmup)))
