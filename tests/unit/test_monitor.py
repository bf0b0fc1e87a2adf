"""Monitor: NVML path against a scripted stand-in ``pynvml``; host sampler for real."""

from __future__ import annotations

import json
import os
import sys
import time
import types
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from harness.measure import monitor as monitor_mod
from harness.measure import nvml_sampler as nvml_sampler_mod
from harness.measure.monitor import HostSampler, Monitor, make_monitor
from harness.measure.nvml_sampler import (
    NVML_SCOPE_ALL_LINKS,
    NvmlUnavailable,
    resolve_devices,
    visible_device_entries,
)
from harness.measure.sampling import counter_delta

NOT_SUPPORTED = 3


class FakeNVMLError(Exception):
    """Maps a return code to a named subclass the way pynvml's NVMLError does."""

    _by_code: dict[int, type] = {}

    def __new__(cls, value: int) -> FakeNVMLError:
        sub = FakeNVMLError._by_code.get(value, cls) if cls is FakeNVMLError else cls
        obj = Exception.__new__(sub)
        obj.value = value
        return obj

    def __init__(self, value: int) -> None:
        super().__init__(value)

    def __str__(self) -> str:
        return {NOT_SUPPORTED: "Not Supported", 12: "NVML Shared Library Not Found"}.get(self.value, "error")


class NVMLError_NotSupported(FakeNVMLError):  # noqa: N801 - pynvml's naming
    pass


class NVMLError_LibraryNotFound(FakeNVMLError):  # noqa: N801
    pass


FakeNVMLError._by_code = {NOT_SUPPORTED: NVMLError_NotSupported, 12: NVMLError_LibraryNotFound}


class FakeGpu:
    def __init__(self, index: int, uuid: str, *, nvlink: bool = True, aggregate_scope: bool = True) -> None:
        self.index, self.uuid, self.nvlink, self.aggregate_scope = index, uuid, nvlink, aggregate_scope
        self.energy_mj = [1000, 2000, 3000, 4000, 5000, 6000]  # scripted counter, last value sticks
        self.energy_calls = 0
        self.nvlink_kib = 0


def make_fake_pynvml(gpus: list[FakeGpu], *, init_error: int | None = None) -> types.ModuleType:
    """A stand-in ``pynvml`` module with scripted per-device values."""
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = FakeNVMLError
    nvml.NVML_SUCCESS = 0
    nvml.NVML_CLOCK_SM = 1
    nvml.NVML_PCIE_UTIL_TX_BYTES, nvml.NVML_PCIE_UTIL_RX_BYTES = 0, 1
    nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 138, 139
    nvml.NVML_NVLINK_MAX_LINKS = 4
    nvml.calls = []
    by_uuid = {g.uuid: g for g in gpus}

    def init() -> None:
        if init_error is not None:
            raise FakeNVMLError(init_error)
        nvml.calls.append("init")

    def by_index(i: int) -> FakeGpu:
        if not 0 <= i < len(gpus):
            raise FakeNVMLError(2)
        return gpus[i]

    def handle_by_uuid(uuid: str) -> FakeGpu:
        if uuid not in by_uuid:
            raise FakeNVMLError(6)
        return by_uuid[uuid]

    def energy(h: FakeGpu) -> int:
        value = h.energy_mj[min(h.energy_calls, len(h.energy_mj) - 1)]
        h.energy_calls += 1
        return value

    def field_values(h: FakeGpu, fields: list[tuple[int, int]]) -> list[Any]:
        out = []
        for field_id, scope in fields:
            ok = h.nvlink and (scope != NVML_SCOPE_ALL_LINKS or h.aggregate_scope)
            if ok:
                h.nvlink_kib += 1024  # counter grows by 1 MiB per read
            out.append(
                types.SimpleNamespace(
                    fieldId=field_id, scopeId=scope, valueType=3, nvmlReturn=0 if ok else NOT_SUPPORTED,
                    value=types.SimpleNamespace(ullVal=h.nvlink_kib if ok else 0),
                )
            )
        return out

    def clocks_event_reasons(h: FakeGpu) -> int:
        raise FakeNVMLError(NOT_SUPPORTED)  # old driver: only the deprecated call works

    nvml.nvmlInit = init
    nvml.nvmlShutdown = lambda: nvml.calls.append("shutdown")
    nvml.nvmlDeviceGetCount = lambda: len(gpus)
    nvml.nvmlDeviceGetHandleByIndex = by_index
    nvml.nvmlDeviceGetHandleByUUID = handle_by_uuid
    nvml.nvmlDeviceGetUUID = lambda h: h.uuid
    nvml.nvmlDeviceGetName = lambda h: b"Fake H200"
    nvml.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=(1000 + h.index) * 2**20)
    nvml.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=90, memory=40)
    nvml.nvmlDeviceGetPowerUsage = lambda h: 350_000  # mW
    nvml.nvmlDeviceGetTotalEnergyConsumption = energy
    nvml.nvmlDeviceGetClockInfo = lambda h, clock: 1980 if clock == 1 else 0
    nvml.nvmlDeviceGetCurrentClocksEventReasons = clocks_event_reasons
    nvml.nvmlDeviceGetCurrentClocksThrottleReasons = lambda h: 0x4
    nvml.nvmlDeviceGetPcieThroughput = lambda h, counter: 123 if counter == 0 else 456
    nvml.nvmlDeviceGetFieldValues = field_values
    return nvml


@pytest.fixture
def no_torch_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvml_sampler_mod, "_torch_cuda_uuids", lambda indices: None)


def run_window(mon: Monitor, seconds: float = 0.0) -> Any:
    mon.start()
    time.sleep(seconds)
    return mon.stop()


def test_nvml_samples_scripted_values(monkeypatch: pytest.MonkeyPatch, no_torch_cuda: None) -> None:
    fake = make_fake_pynvml([FakeGpu(0, "GPU-aaa"), FakeGpu(1, "GPU-bbb", nvlink=False)])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    result = run_window(make_monitor("cuda", [0, 1], rate_hz=50.0), 0.05)
    assert result.sampler == "nvml" and result.note is None
    df = result.samples
    assert len(df) >= 2 and df.columns[0] == "t_s"
    assert (df["gpu0_mem_used_mib"] == 1000.0).all() and (df["gpu1_mem_used_mib"] == 1001.0).all()
    assert (df["gpu0_gpu_util_pct"] == 90).all() and (df["gpu0_mem_util_pct"] == 40).all()
    assert (df["gpu0_power_w"] == 350.0).all() and (df["gpu0_sm_clock_mhz"] == 1980).all()
    assert (df["gpu0_pcie_tx_kb_s"] == 123).all() and (df["gpu0_pcie_rx_kb_s"] == 456).all()
    # Event reasons unsupported -> the deprecated throttle-reasons call is used instead.
    assert (df["gpu0_throttle_reasons"] == 4).all()
    assert type(result.summary["gpu0_throttle_reasons_any"]) is int and result.summary["gpu0_throttle_reasons_any"] == 4
    json.dumps(result.to_record())  # the record entry must be JSON-serialisable
    assert "gpu0_throttle_reasons" not in result.unsupported
    assert result.summary["gpu0_power_w_max"] == 350.0 and result.summary["peak_mem_used_mib"] == 1001.0
    assert [d["uuid"] for d in result.summary["devices"]] == ["GPU-aaa", "GPU-bbb"]
    assert result.summary["devices"][0]["name"] == "Fake H200"
    assert fake.calls[0] == "init" and fake.calls[-1] == "shutdown"


def test_nvml_unsupported_field_is_null_with_reason(monkeypatch: pytest.MonkeyPatch, no_torch_cuda: None) -> None:
    fake = make_fake_pynvml([FakeGpu(0, "GPU-aaa", nvlink=False)])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    result = run_window(make_monitor("cuda", [0], rate_hz=50.0), 0.05)
    assert result.samples["gpu0_nvlink_tx_kib"].isna().all()
    assert "NVMLError_NotSupported" in result.unsupported["gpu0_nvlink_tx_kib"]
    assert result.summary["gpu0_nvlink_tx_kib_total"] is None
    assert result.summary["gpu0_nvlink_tx_kib_s_max"] is None


def test_nvlink_uses_aggregate_scope_then_per_link_sum(monkeypatch: pytest.MonkeyPatch, no_torch_cuda: None) -> None:
    gpu = FakeGpu(0, "GPU-aaa", aggregate_scope=False)
    fake = make_fake_pynvml([gpu])
    requested: list[list[tuple[int, int]]] = []
    real = fake.nvmlDeviceGetFieldValues
    fake.nvmlDeviceGetFieldValues = lambda h, fields: requested.append(list(fields)) or real(h, fields)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    result = run_window(make_monitor("cuda", [0], rate_hz=50.0), 0.0)
    assert requested[0] == [(138, NVML_SCOPE_ALL_LINKS)]  # aggregate asked first, never bare scope 0
    assert requested[1] == [(138, link) for link in range(4)]  # fallback: every link summed
    assert result.summary["gpu0_nvlink_tx_kib_total"] > 0
    rates = result.samples["gpu0_nvlink_tx_kib_s"].dropna()
    assert len(rates) >= 1 and (rates > 0).all()


def test_counter_delta_skips_nulls() -> None:
    samples = pd.DataFrame({"t_s": [0.0, 1.0, 2.0], "gpu0_energy_j": [1.0, None, 6.0]})
    assert counter_delta(samples, "gpu0_energy_j") == 5.0
    assert counter_delta(samples.iloc[:1], "gpu0_energy_j") is None
    assert counter_delta(samples, "missing") is None


def test_energy_counter_1000_to_6000_mj_gives_5_j(monkeypatch: pytest.MonkeyPatch, no_torch_cuda: None) -> None:
    fake = make_fake_pynvml([FakeGpu(0, "GPU-aaa")])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    mon = make_monitor("cuda", [0], rate_hz=1.0)
    mon.sampler.devices[0].handle.energy_mj = [0, 1000, 6000]  # probe, start sample, stop sample
    result = run_window(mon, 0.0)
    assert result.summary["gpu0_energy_j"] == 5.0 and result.summary["energy_j"] == 5.0


def test_uuid_mapping_honours_cuda_visible_devices() -> None:
    fake = make_fake_pynvml([FakeGpu(0, "GPU-aaa"), FakeGpu(1, "GPU-bbb")])
    devices, notes = resolve_devices(fake, [0, 1], "GPU-bbb,GPU-aaa")
    assert [d.uuid for d in devices] == ["GPU-bbb", "GPU-aaa"]
    assert [d.handle.index for d in devices] == [1, 0] and notes == []
    devices, _ = resolve_devices(fake, [0], "1")
    assert devices[0].uuid == "GPU-bbb"
    devices, _ = resolve_devices(fake, [0, 1], None)
    assert [d.uuid for d in devices] == ["GPU-aaa", "GPU-bbb"]


def test_uuid_prefix_and_torch_cross_check() -> None:
    fake = make_fake_pynvml([FakeGpu(0, "GPU-aaa111"), FakeGpu(1, "GPU-bbb222")])
    devices, _ = resolve_devices(fake, [0], "GPU-bbb")  # CUDA accepts unique prefixes
    assert devices[0].uuid == "GPU-bbb222"
    devices, notes = resolve_devices(fake, [0], "0", cuda_uuids=["GPU-bbb222"])
    assert devices[0].uuid == "GPU-bbb222" and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in notes[0]


def test_mig_and_bad_entries_are_reasons() -> None:
    fake = make_fake_pynvml([FakeGpu(0, "GPU-aaa")])
    with pytest.raises(NvmlUnavailable, match="MIG instance"):
        resolve_devices(fake, [0], "MIG-1234")
    with pytest.raises(NvmlUnavailable, match="local CUDA index 1 has no CUDA_VISIBLE_DEVICES entry"):
        resolve_devices(fake, [1], "0")
    assert visible_device_entries(" 0, GPU-x ,") == ["0", "GPU-x"]
    assert visible_device_entries(None) is None


def test_mig_falls_back_to_host_with_note(monkeypatch: pytest.MonkeyPatch, no_torch_cuda: None) -> None:
    fake = make_fake_pynvml([FakeGpu(0, "GPU-aaa")])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-1234")
    mon = make_monitor("cuda", [0])
    assert mon.kind == "host" and "MIG instance" in mon.note and mon.note.endswith("host sampler used")
    assert fake.calls == ["init", "shutdown"]


def test_failed_nvml_init_falls_back_to_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", make_fake_pynvml([], init_error=12))
    mon = make_monitor("cuda", [0])
    assert mon.kind == "host"
    assert mon.note == "n/a: no NVML on this machine (NVMLError_LibraryNotFound); host sampler used"


def test_missing_pynvml_falls_back_to_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    mon = make_monitor("cuda", [0])
    assert mon.kind == "host" and mon.note.startswith("n/a: pynvml not importable")


def test_cpu_device_kind_uses_host(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object) -> None:
        raise AssertionError("NVML must not be opened for device_kind='cpu'")

    monkeypatch.setattr(nvml_sampler_mod, "open_nvml_sampler", forbidden)
    mon = make_monitor("cpu", [])
    assert mon.kind == "host" and "device_kind is 'cpu'" in mon.note


def test_host_sampler_real_process(tmp_path: Path) -> None:
    mon = Monitor(HostSampler([os.getpid()]), rate_hz=20.0)
    mon.start()
    blocks = []
    t_end = time.perf_counter() + 0.3
    while time.perf_counter() < t_end:
        blocks.append(bytearray(4 * 2**20))  # touch memory so RSS moves
        time.sleep(0.02)
    result = mon.stop()
    del blocks
    assert result.sampler == "host" and result.unsupported == {}
    assert len(result.samples) >= 2
    assert result.summary["peak_rss_mib"] > 0 and result.summary["cpu_pct_mean"] is not None
    assert result.samples["t_s"].is_monotonic_increasing
    path = result.save_csv(tmp_path / "samples" / "monitor.csv")
    assert list(pd.read_csv(path).columns) == list(result.samples.columns)
    assert sorted(p.name for p in path.parent.iterdir()) == ["monitor.csv"]  # no temp left behind
    assert result.to_record()["sampler"] == "host"


def test_host_sampler_records_vanished_pid() -> None:
    sampler = HostSampler([2**22 + 12345])  # beyond pid_max: never exists
    assert list(sampler.unsupported) == [f"pid{2**22 + 12345}"]
    assert sampler.sample()["rss_mib_sum"] is None


def test_a_sample_is_stamped_when_its_read_starts(monkeypatch) -> None:
    """The first row sits at t_s = 0 however long the read takes (an NVML read can take tens of ms):
    a clock that only the reads move (1 s each) gives exactly 0 and 1, whatever the machine's load."""
    now = [100.0]

    class SlowRead(HostSampler):
        def sample(self) -> dict:
            now[0] += 1.0
            return super().sample()

    monkeypatch.setattr(monitor_mod, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    mon = Monitor(SlowRead([os.getpid()]), rate_hz=1e-3)
    mon.start()
    assert list(mon.stop().samples["t_s"]) == [0.0, 1.0]


@pytest.mark.timeout(120)  # a hang guard, not a measurement: stop() is a few ms, the period 1000 s
def test_stop_is_prompt_and_guards_misuse() -> None:
    mon = Monitor(HostSampler(), rate_hz=1e-3)  # stop() must not wait out the 1000 s period
    with pytest.raises(RuntimeError, match="stop\\(\\) without start"):
        mon.stop()
    mon.start()
    with pytest.raises(RuntimeError, match="called twice; a Monitor is single-use"):
        mon.start()
    result = mon.stop()
    assert len(result.samples) == 2
    with pytest.raises(ValueError, match="rate_hz \\(0\\) must be a positive finite rate"):
        Monitor(HostSampler(), rate_hz=0)


def test_sampler_thread_failure_is_raised() -> None:
    class Exploding(HostSampler):
        calls = 0

        def sample(self) -> dict[str, float | None]:
            self.calls += 1
            if self.calls > 1:
                raise OSError("sensor gone")
            return super().sample()

    mon = Monitor(Exploding(), rate_hz=100.0)
    mon.start()
    time.sleep(0.05)
    with pytest.raises(RuntimeError, match="host monitor sampling thread failed: OSError"):
        mon.stop()


def test_host_monitor_samples_between_steps_never_on_a_thread(monkeypatch) -> None:
    """Issue 62: the host sampler reads between steps (``tick``, after a step's clock stopped), at most at its rate,
    on no thread of its own: a clock that only the test moves decides exactly which ticks sample."""
    now = [100.0]
    monkeypatch.setattr(monitor_mod, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    mon = make_monitor("cpu", [], rate_hz=10.0, pids=[os.getpid()])
    assert mon.between_steps
    threads = {t.name for t in monitor_mod.threading.enumerate()}
    mon.start()
    assert "harness-monitor" not in {t.name for t in monitor_mod.threading.enumerate()} - threads
    for t in (100.05, 100.099, 100.1, 100.15, 100.35, 100.38, 100.41, 100.44):  # steps ending at these times
        now[0] = t
        mon.tick()
    now[0] = 100.5
    result = mon.stop()
    # start at 0; due at .1: sampled at .1; due at .2, a long step: sampled at .35; due at .4 (the schedule's next
    # point, no burst): sampled at .41; stop at .5
    assert [round(t, 3) for t in result.samples["t_s"]] == [0.0, 0.1, 0.35, 0.41, 0.5]
    assert result.summary["sampled"] == "between steps"
    mon.tick()  # after stop: nothing is due, nothing recorded
    assert len(mon._rows) == 5


def test_nvml_monitor_keeps_its_thread(monkeypatch: pytest.MonkeyPatch, no_torch_cuda: None) -> None:
    """NVML's gauges (utilisation, power) describe the GPU while it works: sampled on a thread, ``tick`` a no-op."""
    monkeypatch.setitem(sys.modules, "pynvml", make_fake_pynvml([FakeGpu(0, "GPU-aaa")]))
    mon = make_monitor("cuda", [0], rate_hz=1e-3)
    assert mon.kind == "nvml" and not mon.between_steps
    mon.start()
    mon.tick()
    result = mon.stop()
    assert len(result.samples) == 2 and result.summary["sampled"] == "on a thread"
