"""GPUs and interconnects from datasheets, and the collective time they imply, for what-if planning.

Nothing here is measured on the named machines: each value is a vendor figure (source beside
it) or a typical NCCL-level figure, and ``harness plan --device NAME`` prints its answers as
predictions. Bandwidths are GB/s (1e9 bytes/s) **per GPU per direction**; NVIDIA quotes NVLink
as the bidirectional total, so 900 GB/s NVLink 4 is 450 GB/s each way.

**Collective time** (Hockney alpha-beta model, with the nccl-tests bus-bandwidth convention of
``harness.measure.comm_counter.BUS_FACTOR``; nccl-tests ``doc/PERFORMANCE.md``)::

    t = latency + nbytes * busbw_factor(collective, n) / link_bw

``nbytes`` is the nccl-tests size of the call (:mod:`harness.model.comm`), ``n`` the group size, and
``link_bw`` the bus bandwidth NCCL reaches on the link: its line rate times :attr:`Interconnect.nccl_share`
(NCCL's protocol overhead, from NVIDIA's statements of what nccl-tests shows on DGX H100). A group inside one node runs at the intra-node link (NVLink or PCIe). A group spanning nodes
runs at ``min(intra, g * nic)`` where ``g`` is the group's ranks on one node: NCCL runs one
ring (channel) per NIC, every GPU has its own NIC (DGX H100 / DGX A100 layout), and the
inter-node traffic of a node is spread over the NICs of the group's GPUs there, so a group
with one rank per node is bottlenecked by one NIC, and a group holding a whole node by all of
them (nccl issue #1250: the same all-reduce over 2 nodes is 2x faster with 2 GPUs per node
than with 1; nccl-tests issue #232: with 4 NICs one expects 4x one NIC's busbw).

**Placement**: ranks fill nodes in order (torchrun), and the mesh is (pp, dp_replicate,
dp_shard, tp) with tp innermost (:mod:`harness.parallel.dims`), so a tp group of at most
``gpus_per_node`` ranks stays on NVLink, while dp and pp groups stride over ``tp`` (and
``tp x dp``) ranks and span nodes as soon as the stride times the size exceeds a node.

Latency is one constant per call: the growth of NCCL's ring/tree latency with the group size is
not modelled; at this harness's message sizes (MB to GB) the bandwidth term dominates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from harness.errors import UsageError
from harness.measure.comm_counter import BUS_FACTOR
from harness.measure.peaks import datasheet_peaks
from harness.model.device_rates import attention_names, attention_source, calibrated, op_rates
from harness.model.op_cost import Device as PricedDevice
from harness.model.op_cost import OpRates
from harness.parallel.dims import ParallelDims
from harness.units import GIB, MIB

MAMF_FRACTION = 700.9 / 989.5
"""Achievable matmul fraction of the datasheet peak: calibrated bf16 matmul peak 700.9 TFLOP/s over
the 989.5 datasheet on one H200 (``results/gpu/calibration.json``, ``results/gpu/README.md``).
Measured on that one chip; an assumption for every other device."""
KERNEL_EFFICIENCY = 0.589
"""Fraction of the calibrated matmul peak a whole training step reached: ``xl`` bf16 on one H200,
MFU 58.9% of the calibrated peak (``results/gpu/summary-sizes.md``). Measured for that size and
chip only; an assumption elsewhere (smaller models reach less). The measured step includes the
AdamW update, which the what-if also prices on its own (at the HBM bandwidth), so an unsharded
optimizer is counted twice: ``xl`` bf16 on one H200 is predicted at 46,437 tokens/s against the
48,708 measured (-4.7%); sharded strategies divide that term by the shard count."""
DEFAULT_EFFICIENCY = MAMF_FRACTION * KERNEL_EFFICIENCY
"""What-if compute rate as a fraction of the datasheet peak (``--efficiency`` overrides it)."""


@dataclass(frozen=True)
class Interconnect:
    name: str
    gbps: float
    """GB/s per GPU per direction (for a network: the GPU's own NIC): the line rate."""
    latency_s: float
    """Per-call latency at NCCL level: a typical figure, not a datasheet one."""
    source: str
    nccl_share: float = 1.0
    """The share of :attr:`gbps` NCCL's bus bandwidth reaches on it (its protocol's overhead; nccl-tests' busbw)."""
    nccl_source: str = "not stated: the line rate"

    @property
    def nccl_gbps(self) -> float:
        """What a collective moves per GPU and direction on this link: the busbw nccl-tests would report."""
        return self.gbps * self.nccl_share


NCCL_NVLINK_SHARE = 370.0 / 450.0
"""What NCCL reaches of NVLink's line rate: "450GB/s is the line rate. With the protocol overhead (~20%) NCCL can
get an effective NVLink bandwidth of 370GB/s, which you can observe as 'BusBw' when running non-allreduce
operations" (NCCL's maintainer on 8 H100s, nccl-tests issue #212; #326: "360 GB/s is exactly what we'd expect on
H100"). The protocol's overhead is taken to be the same on NVLink 3 and 5. NVLink SHARP's all-reduce (480 GB/s busbw
on H100) is not priced: all-reduces run at this share too."""
NCCL_NDR_SHARE = 47.0 / 50.0
"""What NCCL reaches of an NDR NIC: "expect 46-48 GB/s busbw per NDR NIC" (NVIDIA, nccl-tests issue #290), the
middle; taken for HDR too."""
NVLINK_NCCL = "nccl-tests #212: 370 of 450 GB/s on H100 (NCCL's protocol overhead)"
IB_NCCL = "nccl-tests #290: 46-48 GB/s busbw per NDR NIC"


# NVIDIA NVLink page and A100/H100 datasheets: NVLink 3 600 GB/s, NVLink 4 900 GB/s total
# bidirectional per GPU. Latency: NCCL small-message all-reduce / sendrecv inside an NVLink node
# is a few us (nccl issue #1259: ~6 us on 2 H100s with NVLS; nccl issue #1984: ~3.5 us on H800s).
NVLINK3 = Interconnect("NVLink 3", 300.0, 5e-6, "A100 datasheet: 600 GB/s bidirectional", NCCL_NVLINK_SHARE,
                       NVLINK_NCCL)
NVLINK4 = Interconnect("NVLink 4", 450.0, 5e-6, "H100/H200 datasheets: 900 GB/s bidirectional", NCCL_NVLINK_SHARE,
                       NVLINK_NCCL)
NVLINK5 = Interconnect("NVLink 5", 900.0, 5e-6, "DGX B200 user guide: NVLink switches of 14.4 TB/s aggregate for 8 GPUs",
                       NCCL_NVLINK_SHARE, NVLINK_NCCL)
# PCI-SIG: Gen4 x16 16 GT/s x 16 lanes ~ 32 GB/s per direction, Gen5 x16 ~ 64 GB/s (the datasheets'
# "64 GB/s" for A100 and "128 GB/s" for H100 are bidirectional). Latency: assumed ~2x NVLink.
PCIE4 = Interconnect("PCIe Gen4 x16", 32.0, 10e-6, "PCIe 4.0 x16: 64 GB/s bidirectional")
PCIE5 = Interconnect("PCIe Gen5 x16", 64.0, 10e-6, "PCIe 5.0 x16: 128 GB/s bidirectional")
# InfiniBand line rates: HDR 200 Gb/s = 25 GB/s, NDR 400 Gb/s = 50 GB/s per NIC and direction
# (nccl-tests issue #290, NVIDIA: expect 46-48 GB/s busbw per NDR NIC). One NIC per GPU as in
# DGX A100 (8 x ConnectX-6 HDR) and DGX H100 (8 x ConnectX-7 NDR) user guides. Latency: typical
# 5-10 us per inter-node NCCL hop; the upper end is used.
IB_HDR = Interconnect("InfiniBand HDR 200 Gb/s", 25.0, 10e-6, "HDR line rate, one NIC per GPU (DGX A100)",
                      NCCL_NDR_SHARE, IB_NCCL)
IB_NDR = Interconnect("InfiniBand NDR 400 Gb/s", 50.0, 10e-6, "NDR line rate, one NIC per GPU (DGX H100)",
                      NCCL_NDR_SHARE, IB_NCCL)


@dataclass(frozen=True)
class Device:
    name: str
    """Preset name on the command line (``--device h100``)."""
    product: str
    """Product name as CUDA reports it; looked up in the datasheet peak table of :mod:`harness.measure.peaks`."""
    hbm_gib: float
    """Memory per GPU in GiB, as the driver reports the total (what a peak has to fit under)."""
    hbm_gbps: float
    """Memory bandwidth, GB/s (datasheet)."""
    gpus_per_node: int
    intra: Interconnect
    inter: Interconnect
    source: str
    tdp_w: float = 0.0
    """Board power at which the datasheet peaks hold (0: not stated; a power cap is then refused)."""
    power_cap_w: float | None = None
    """A power limit below the board power (``--power-cap``): the compute peaks scale by :attr:`compute_scale`."""
    peaks: tuple[tuple[str, float], ...] | None = None
    """Dense peaks by dtype given in a device file, in place of the datasheet table's for :attr:`product`."""
    overrides: tuple[str, ...] = ()
    """What differs from the preset, in words, for the what-if's header."""
    rates_preset: str | None = None
    """The preset whose op rates (harness/model/device_rates.toml) this device runs at: its own name for a preset,
    a device file's ``base``; None: the file gives them all (:attr:`rate_overrides`)."""
    rate_overrides: tuple[tuple[str, object], ...] = ()
    """Op-rate fields a device file gives (``[op_rates]``), over its base preset's."""
    measured_ops: dict | None = field(default=None, compare=False, hash=False)
    """What ``harness calibrate --ops`` measured on a device of this product (set by
    :func:`harness.calibration.ops.with_measured`), in place of the data file's figures."""

    @property
    def op_rates(self) -> OpRates:
        """What each kind of op runs at on this device (:mod:`harness.model.device_rates`), or what ``harness
        calibrate --ops`` measured on one (:attr:`measured_ops`)."""
        preset = DEVICES.get(self.rates_preset or "")
        rates = op_rates(self.rates_preset, self.peak_tflops, preset.hbm_gbps if preset else self.hbm_gbps,
                         dict(self.rate_overrides))
        if self.measured_ops is None:
            return rates
        return calibrated(rates, self.measured_ops, self.peak_tflops, self.hbm_gbps)

    def priced(self) -> PricedDevice:
        """The device as the op-by-op pricing takes it (:mod:`harness.model.op_cost`)."""
        return PricedDevice(rates=self.op_rates, peak_tflops=self.peak_tflops, hbm_gbps=self.hbm_gbps,
                            compute_scale=self.compute_scale)

    @property
    def compute_scale(self) -> float:
        """What a power cap leaves of the compute peaks: ``(cap / board power) ** (1/3)``. Dynamic power goes as
        frequency x voltage squared and the voltage follows the frequency, so power ~ frequency cubed, and a
        capped part runs its matmuls at the clock the cap sustains. HBM and link bandwidths are not scaled."""
        if self.power_cap_w is None:
            return 1.0
        return (self.power_cap_w / self.tdp_w) ** (1 / 3)

    @property
    def peak_tflops(self) -> dict[str, float]:
        """Dense peaks by compute dtype: the datasheet table's (:mod:`harness.measure.peaks`) or a device file's.
        MFU divides by these, as published MFUs do, capped or not; the compute runs at :attr:`compute_scale` of them."""
        peaks = dict(self.peaks) if self.peaks is not None else datasheet_peaks(self.product)
        if peaks is None:  # a preset must name a product the peak table has; a test holds this
            raise ValueError(f"device preset {self.name}: {self.product!r} is not in harness/measure/peaks.py")
        return peaks


def with_overrides(device: Device, *, hbm_gib: float | None = None, power_cap_w: float | None = None,
                   attention: str | None = None) -> Device:
    """A preset with its memory, its power limit or its attention kernel changed (``--device-mem``, ``--power-cap``,
    ``--attention-kernel``); the header says what changed. A cap above the board power changes nothing and is
    refused, as is a cap on a part whose board power is not stated."""
    changes: dict = {}
    said = list(device.overrides)
    if attention is not None:
        tables = attention_names()
        if attention not in tables:
            raise UsageError(f"--attention-kernel {attention!r}: choose from {', '.join(tables)} "
                             f"(harness/model/device_rates.toml's measured tables)")
        changes["rate_overrides"] = (*device.rate_overrides, ("attention", attention))
        said.append(f"attention kernel {attention} ({attention_source(attention)})")
    if hbm_gib is not None:
        if not 0 < hbm_gib < math.inf:
            raise UsageError(f"--device-mem {hbm_gib!r}: must be a finite number > 0 GiB, e.g. 96")
        changes["hbm_gib"] = hbm_gib
        said.append(f"memory {hbm_gib:g} GiB (preset {device.hbm_gib:.1f})")
    if power_cap_w is not None:
        if not device.tdp_w:
            raise UsageError(f"--power-cap {power_cap_w:g}: {device.name} states no board power to scale from; "
                             f"give tdp_w in a device file")
        if not 0 < power_cap_w <= device.tdp_w:
            raise UsageError(f"--power-cap {power_cap_w:g} W: must be in (0, {device.tdp_w:g}] W, {device.name}'s board "
                             f"power (a higher limit changes nothing)")
        changes["power_cap_w"] = power_cap_w
        capped = replace(device, power_cap_w=power_cap_w)
        said.append(f"power cap {power_cap_w:g} W of {device.tdp_w:g} W: compute peaks x {capped.compute_scale:.3f} "
                    f"(cube root of the power ratio; HBM and links unscaled)")
    return replace(device, **changes, overrides=tuple(said)) if changes else device


DEVICES: dict[str, Device] = {d.name: d for d in (
    # H100 SXM5 datasheet: 80 GB HBM3, 3.35 TB/s, up to 700 W; nvidia-smi reports 81,559 MiB. DGX H100: 8 GPUs,
    # NVSwitch, 8 x NDR. Board powers below from the same datasheets: H100 PCIe 350 W, H200 SXM 700 W, A100 SXM 400 W.
    Device("h100", "NVIDIA H100 80GB HBM3", 81559 * MIB / GIB, 3350.0, 8, NVLINK4, IB_NDR,
           "NVIDIA H100 datasheet (SXM5); DGX H100 user guide", tdp_w=700.0, rates_preset="h100"),
    # H100 PCIe datasheet: 80 GB HBM2e, 2.0 TB/s; no NVLink bridge assumed (GPU-GPU over PCIe Gen5);
    # 8 GPUs and one NDR NIC per GPU per node assumed; memory total assumed equal to the SXM part's.
    Device("h100-pcie", "NVIDIA H100 PCIe", 81559 * MIB / GIB, 2000.0, 8, PCIE5, IB_NDR,
           "NVIDIA H100 PCIe product brief PB-11133-001", tdp_w=350.0, rates_preset="h100-pcie"),
    # H200 SXM datasheet: 141 GB HBM3e, 4.8 TB/s; 143,771 MiB measured by nvidia-smi on the lent H200
    # (results/gpu/nvidia-smi.csv). DGX H200: 8 GPUs, NVLink 4, 8 x NDR.
    Device("h200", "NVIDIA H200", 143771 * MIB / GIB, 4800.0, 8, NVLINK4, IB_NDR,
           "NVIDIA H200 datasheet; results/gpu/nvidia-smi.csv", tdp_w=700.0, rates_preset="h200"),
    # A100 80GB SXM datasheet: 80 GB HBM2e, 2,039 GB/s; CUDA reports 85,056,798,720 bytes. DGX A100: 8 GPUs, 8 x HDR.
    Device("a100", "NVIDIA A100-SXM4-80GB", 85_056_798_720 / GIB, 2039.0, 8, NVLINK3, IB_HDR,
           "NVIDIA A100 datasheet (80GB SXM); DGX A100 user guide", tdp_w=400.0, rates_preset="a100"),
    # A100 40GB SXM4: 40 GB HBM2 at 1,555 GB/s, 400 W, 108 SMs (NVIDIA's Hopper Architecture In-Depth blog, Table 3,
    # whose A100 column is this part). The total the driver reports is assumed in the 80 GB part's proportion.
    Device("a100-40gb", "NVIDIA A100-SXM4-40GB", 85_056_798_720 / GIB / 2, 1555.0, 8, NVLINK3, IB_HDR,
           "NVIDIA Hopper Architecture In-Depth blog, Table 3 (A100 40GB SXM4); DGX A100 user guide", tdp_w=400.0,
           rates_preset="a100-40gb"),
    # DGX B200 user guide: 8 B200 GPUs with 1,440 GB in all (180 GB each), fifth-generation NVLink switches with
    # 14.4 TB/s aggregate (1.8 TB/s per GPU, 900 GB/s each way), 8 ConnectX-7 at 400 Gb/s; HBM3e at 8 TB/s and a
    # 1,000 W maximum TGP (MLE's memory and power tables). The total the driver reports is not read: 180 GB stated.
    Device("b200", "NVIDIA B200", 180e9 / GIB, 8000.0, 8, NVLINK5, IB_NDR,
           "DGX B200 user guide; MLE's B200 SXM rows (memory, power)", tdp_w=1000.0, rates_preset="b200"),
)}


def get_device(name: str) -> Device:
    """A preset by (case-insensitive) name; the error lists the names."""
    try:
        return DEVICES[name.lower()]
    except KeyError:
        raise UsageError(f"--device {name!r} is not in the hardware table; choose auto, cpu, cuda (bench) or "
                         f"{', '.join(DEVICES)} (plan what-if)") from None


@dataclass(frozen=True)
class GroupPlacement:
    """Where the groups along one mesh dimension sit."""

    size: int
    ranks_per_node: int
    """The fewest group members any node holds (the slowest group sets the pace)."""

    @property
    def spans_nodes(self) -> bool:
        return self.ranks_per_node < self.size


def placement(dims: ParallelDims, gpus_per_node: int) -> dict[str, GroupPlacement]:
    """Per mesh dimension, the groups' size and members per node (ranks fill nodes in order).

    ``pp_p2p`` is the pair of neighbouring stages a pipeline send/recv runs between (group 2);
    ``world`` every rank (an MoE's load all-reduce, :mod:`harness.parallel.expert_load`); ``ep`` and
    ``efsdp`` split dp_shard, ep inner (:data:`harness.parallel.dims.EP_MESH_ORDER`).
    """
    tp, cp = dims.tp, dims.cp
    strides = {"tp": 1, "cp": tp, "dp_shard_cp": tp, "dp_shard": tp * cp, "dp_replicate": tp * cp * dims.dp_shard,
               "pp": tp * cp * dims.dp_shard * dims.dp_replicate, "world": 1, "ep": tp * cp,
               "efsdp": tp * cp * dims.ep}
    sizes = {**dims.degrees(), "cp": cp, "dp_shard_cp": dims.fsdp_shards, "world": dims.world_size, "ep": dims.ep,
             "efsdp": dims.efsdp}
    out = {}
    for dim, stride in strides.items():
        n = sizes[dim]
        fewest = n
        for first in range(dims.world_size):  # one group per first member: no earlier member below it
            if (first // stride) % n:
                continue
            per_node: dict[int, int] = {}
            for k in range(n):
                node = (first + k * stride) // gpus_per_node
                per_node[node] = per_node.get(node, 0) + 1
            fewest = min(fewest, min(per_node.values()))
        out[dim] = GroupPlacement(n, fewest)
    stride = strides["pp"]
    crosses = any(r // gpus_per_node != (r + stride) // gpus_per_node
                  for r in range(dims.world_size - stride))  # ranks below the last stage
    out["pp_p2p"] = GroupPlacement(2 if dims.pp_enabled else 1, 1 if crosses else 2)
    return out


def link_for(device: Device, where: GroupPlacement) -> tuple[float, float, str]:
    """(GB/s NCCL reaches, latency s, description) of the link a group's collective is limited by."""
    if not where.spans_nodes:
        return device.intra.nccl_gbps, device.intra.latency_s, device.intra.name
    gbps = min(device.intra.nccl_gbps, where.ranks_per_node * device.inter.nccl_gbps)
    return gbps, device.inter.latency_s, f"{where.ranks_per_node} x {device.inter.name}"


def collective_time_s(device: Device, collective: str, nbytes: float, where: GroupPlacement) -> float:
    """``latency + nbytes * busbw_factor / link_bw`` for one call; 0 for a group of one."""
    if where.size <= 1:
        return 0.0
    gbps, latency, _ = link_for(device, where)
    return latency + nbytes * BUS_FACTOR[collective](where.size) / (gbps * 1e9)


# Which mesh dimensions issue each collective (harness.model.comm): pp stage pairs send/receive, tp and
# DDP/HSDP all-reduce, tp (sequence parallel, LM head), FSDP (over dp_shard x cp) and cp's K/V
# all-gather / reduce-scatter.
_DIMS_OF = {"send_recv": ("pp_p2p",), "send": ("pp_p2p",), "recv": ("pp_p2p",), "all_reduce": ("tp", "dp_replicate"),
            "all_gather": ("tp", "dp_shard_cp", "cp"), "reduce_scatter": ("tp", "dp_shard_cp", "cp")}


def comm_time_fn(device: Device, dims: ParallelDims,
                 gpus_per_node: int | None = None) -> Callable[..., float]:
    """A ``comm_time(collective, nbytes, group, dim=None)`` for :func:`harness.model.step_time.predict_step`.

    ``predict_step`` passes the group size but not the mesh dimension, so the dimension is the
    one of that size that issues this collective; when two dimensions qualify (e.g. tp 2 and
    dp_replicate 2 both all-reduce) the slower placement is priced, a pessimistic choice.
    """
    where = placement(dims, gpus_per_node or device.gpus_per_node)
    dims_of = {k: v for k, v in where.items() if k not in ("pp_p2p", "world")}  # what a call with no dim may run over

    def comm_time(collective: str, nbytes: int, group: int, dim: str | None = None) -> float:
        names = _DIMS_OF.get(collective, tuple(dims_of))
        if dim == "dp":  # harness.model.comm.Call.dim says dp for both data-parallel dimensions
            names = tuple(d for d in names if d.startswith("dp")) or ("dp_shard_cp", "dp_replicate")
        elif dim is not None:
            names = ("pp_p2p",) if dim == "pp" and collective in ("send_recv", "send", "recv") else (dim,)
        cands = [where[d] for d in names if where[d].size == group]
        if not cands:
            if group <= 1:
                return 0.0
            raise ValueError(f"no mesh dimension of size {group} issues {collective} under {dims.degrees()}")
        return max(collective_time_s(device, collective, nbytes, w) for w in cands)

    return comm_time
