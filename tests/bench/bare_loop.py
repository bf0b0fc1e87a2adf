"""The ``single`` cell's training as plainly as it can be written: same model, data, batch and threads.

``python -m tests.bench.bare_loop STEPS WARMUP THREADS [DEVICE SIZE PRECISION]`` prints the median step time (s) of
a fresh process; :func:`median_step_s` runs the same loop in the calling process. On CUDA (``cuda small bf16``, the
GPU check of issue 62 in scripts/gpu_checks.sh) each step is timed by the harness's own clock, a pair of CUDA events
synchronised at the step's end (:class:`harness.measure.timer.StepTimer`), under autocast when the precision is bf16.
It imports no pytest (the lent GPU's image may lack it).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
from dataclasses import replace

import torch

from harness.measure.timer import StepTimer
from workloads.data import MarkovData
from workloads.model import Decoder, lm_loss
from workloads.sizes import get_size

SIZE, SEQ_LEN, BATCH = "tiny", 128, 8


def bare_step(model, opt, x, y) -> torch.Tensor:
    """The plainest correct training step: what the harness's step must not be slower than."""
    opt.zero_grad(set_to_none=True)
    loss = lm_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def median_step_s(steps: int, warmup: int, device: str = "cpu", size_name: str = SIZE,
                  precision: str = "fp32") -> float:
    size = replace(get_size(size_name), seq_len=SEQ_LEN)
    torch.manual_seed(0)
    with torch.device(device):
        model = Decoder(size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    data = MarkovData(size.vocab_size, SEQ_LEN, seed=0)
    timer = StepTimer(device)
    times = []
    for step in range(warmup + steps):
        x, y = (t.to(device) for t in data.batch(step, BATCH))
        timer.start()
        with torch.autocast(device, torch.bfloat16) if precision == "bf16" else contextlib.nullcontext():
            bare_step(model, opt, x, y)
        times.append(timer.stop())
    return statistics.median(times[warmup:])


if __name__ == "__main__":
    steps, warmup, threads = (int(a) for a in sys.argv[1:4])
    torch.set_num_threads(threads)
    print(json.dumps(median_step_s(steps, warmup, *sys.argv[4:7])))
