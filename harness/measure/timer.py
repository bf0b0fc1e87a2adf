"""Step timers: CUDA events on GPU, ``perf_counter`` on CPU, synchronized before reading."""

from __future__ import annotations

import time

import torch


class StepTimer:
    """``start()``/``stop() -> seconds``. On CUDA the end event is synchronized, so the
    time covers all work the step queued, not just its launch."""

    def __init__(self, device_kind: str) -> None:
        self.cuda = device_kind == "cuda"
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
        self._t0 = 0.0

    def start(self) -> None:
        if self.cuda:
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self._end.record()
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1e3
        return time.perf_counter() - self._t0
