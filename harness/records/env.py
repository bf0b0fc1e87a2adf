"""The environment a record was measured in: commit, versions, devices, host."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass  # not Linux: fall through to platform's answer
    return platform.processor() or platform.machine()


def nccl_version() -> str | None:
    if not torch.cuda.is_available():
        return None
    try:
        v = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def driver_version() -> str | None:
    if not torch.cuda.is_available():
        return None
    try:
        import pynvml  # noqa: PLC0415  (optional: NVML is absent on CPU machines)
    except ImportError:
        return "n/a: nvidia-ml-py not installed"
    try:
        pynvml.nvmlInit()
        return pynvml.nvmlSystemGetDriverVersion()
    except pynvml.NVMLError as e:
        return f"n/a: {e}"


def capture(device_kind: str) -> dict:
    sha = _git("rev-parse", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    cuda = device_kind == "cuda" and torch.cuda.is_available()
    return {
        "git_sha": sha,
        "git_dirty": bool(dirty) if dirty is not None else None,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl_version() if cuda else None,
        "device_kind": device_kind,
        "device_name": torch.cuda.get_device_name() if cuda else cpu_model(),
        "device_count": torch.cuda.device_count() if cuda else 1,
        "driver": driver_version() if cuda else None,
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
    }
