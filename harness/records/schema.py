"""The record's ``metrics``, typed: one TypedDict per part, merged into :class:`CellMetrics`.

The worker builds the measured parts (:mod:`harness.run.record_metrics`), the sweep adds
:class:`RunMetrics` (wall time, the plan's memory estimate, parity) in the same module, and
every reader (report, compare) reads these keys. ``docs/records.md`` lists exactly these keys;
``tests/unit/test_records_schema.py`` holds the two against each other.
"""

from __future__ import annotations

from typing import Any, TypedDict


class TimingMetrics(TypedDict):
    conventions: dict[str, str]
    step_time_s: dict[str, float]
    """``{"n","median","p10","p90","mean","std","cv"}`` of the measured steps (``Stats.as_dict()``), seconds."""
    unstable: bool
    unstable_reason: str | None
    tokens_per_step: int


class ThroughputMetrics(TypedDict):
    tokens_per_s: float
    tokens_per_s_per_device: float
    tflops_per_device: float


class MfuMetrics(TypedDict):
    peak_tflops: float | None
    mfu_pct: float | None
    mfu_reason: str | None


class CalibratedMfuMetrics(TypedDict):
    calibrated_tflops: float | None
    mfu_calibrated_pct: float | None
    mfu_calibrated_reason: str | None


class MemoryMetrics(TypedDict, total=False):
    threads_per_rank: int | None
    peak_mem_gib: float
    peak_mem_gib_per_rank: list[float]
    peak_mem_kind: str
    peak_mem_reserved_gib: float
    """CUDA only."""
    peak_tensor_gib: float
    """CPU only: live tensor storages at the peak of an untimed step (the CUDA allocator's measure)."""
    peak_tensor_gib_per_rank: list[float]
    mem_capacity_pct: float
    """CUDA only."""
    model_state_bytes_per_rank: int
    model_state_bytes_by_rank: list[int]
    model_state_breakdown_rank0: dict[str, int]


class CommMetrics(TypedDict, total=False):
    comm: dict[str, dict[str, float]]
    """Calls and bytes per step by collective (per-step means over the counted steps)."""
    comm_by_rank: list[dict[str, dict[str, float]]]
    comm_bytes_per_step: float
    comm_cp: dict[str, dict[str, float]]
    """Context parallel only: its K/V all-gathers and gradient reduce-scatters (also in ``comm``)."""
    cp_comm_bytes_per_step: float


class LossMetrics(TypedDict):
    loss: list[float]
    final_loss: float | None
    entropy_floor: float
    target_loss: float
    target_margin_nats: float | None
    steps_to_target: int | None
    time_to_target_s: float | None
    target_reason: str | None
    lr: float


class PrecisionMetrics(TypedDict, total=False):
    precision: dict[str, Any]
    fp16_skipped_steps: int
    """fp16 cells only."""
    fp16_final_scale: float
    """fp16 cells only."""
    fp8: dict[str, Any]
    """fp8 cells only: ``recipe``, ``emulated``, ``float8_all_gather``, ``linears_converted`` against
    ``linears_model`` (:func:`harness.model.block_ops.fp8_linears`), ``not_converted`` and
    ``converted_not_in_model`` (both empty in a correct cell; parity fails otherwise)."""


class InstrumentMetrics(TypedDict, total=False):
    gns: dict[str, Any]
    pipeline: dict[str, Any]
    """Pipeline strategies only."""
    monitor: dict[str, Any]
    energy_j_per_token: float
    """NVML energy counter only."""
    trace: dict[str, Any]
    """With ``--profile`` only."""
    nvtx: dict[str, Any]
    """NVTX on only: ``enabled``, ``tool_attached`` (calls reach a tool), ``backend`` and ``reason``
    (:meth:`harness.measure.nvtx_ranges.Ranges.describe`)."""
    compile: dict[str, Any]
    """``compile on`` only (:func:`harness.measure.compile_stats.compile_metrics`)."""
    checkpoint: dict[str, Any]
    """``--checkpoint sync|async`` only (:func:`harness.run.checkpoint_metrics.checkpoint_metrics`): ``mode``,
    ``every``, ``saves``, per save the slowest rank's ``blocking_s`` and their median, ``background_s_median``
    (async), ``cost_per_step_pct``, ``bytes_written_by_rank``, ``write_gib_per_s`` and the ``restore`` check
    (``from_step``, ``steps_replayed``, ``load_s``, ``bytes_read_by_rank``, ``loss_max_abs_diff``)."""

    observed: dict[str, Any]
    """What the run did, by rank (``by_rank``: :func:`harness.run.worker._observed`): ``ops`` (the counted step's
    ``forward_matmuls`` and ``backward_matmuls``, per block its forward ``calls``, ``matmuls``, ``every_other`` and
    ``attn_core``, and watched ``ops`` such as ``fused_adamw``: :mod:`harness.measure.op_tally`),
    ``frames_compiled`` (dynamo, over the cell's steps) and ``fp8`` (the float8 linears' ``recipes`` and
    ``float8_all_gather``). The evidence ``claims`` is judged on."""


class ProbeMetrics(TypedDict, total=False):
    """Step 1 in numbers (:mod:`harness.measure.parity_probe`); absent from records before they were added."""

    grad_norm_step1: float | None
    """Global L2 norm of the gradient the optimizer saw at step 1 (unscaled); null if a parameter had none."""
    param_norm_step1: float
    """Global L2 norm of the parameters after step 1's update."""


class MoeMetrics(TypedDict, total=False):
    moe: dict[str, Any]
    """MoE only (:meth:`harness.parallel.expert_load.ExpertLoad.summary`): ``routing``, ``tokens_per_expert``
    (per step, layers x experts, over the global batch), ``imbalance_max_over_mean`` (busiest expert
    over the mean; mean and ``_worst`` over layers and steps), and ``tflops_per_device_total_params`` /
    ``mfu_total_params_pct``: the same step counted on every parameter as if active, which overstates
    an MoE's FLOPs (``tflops_per_device`` and ``mfu_pct`` count the active ones). Under expert parallel,
    ``ep``: ``tokens_left_rank_share`` (routed rows sent to another rank's experts over all routed rows,
    measured steps, every rank) and ``counted_step_rows_sent_by_rank`` / ``..._received_by_rank`` (the
    rows of the step the comm counter counted, from which :func:`harness.model.comm.ep_bytes` gives its
    all-to-all bytes), with ``counted_step_rerun_rows_sent_by_rank`` / ``..._received_by_rank`` the rows of
    the layers whose forward activation checkpointing ran again (their all-to-alls ran twice)."""


class WorkerMetrics(TimingMetrics, ThroughputMetrics, MfuMetrics, MemoryMetrics, CommMetrics, LossMetrics,
                    ProbeMetrics, PrecisionMetrics, InstrumentMetrics, MoeMetrics, total=False):
    """What rank 0 measures and writes to ``result.json``."""

    worker_wall_s: float


class RunMetrics(TypedDict, total=False):
    """What the sweep adds when the cell's record is written (failed cells carry only these)."""

    claims: list[dict[str, Any]]
    """Each claim the record makes, checked against the run (:func:`harness.run.claims.judge`): ``claim``,
    ``value``, ``status`` (``checked``, ``contradicted``, ``n/a``) and ``compared`` (what was held to what) or
    ``reason`` (why it cannot be checked here). A contradicted claim makes the cell's status ``contradicted``."""

    wall_s: float
    est_mem_gib: float | None
    parity_max_rel_diff: float | None
    parity: dict[str, Any]
    batch_search: dict[str, Any]
    """``--batch auto`` only (:meth:`harness.run.batch_search.BatchSearch.as_dict`)."""
    overhead: dict[str, Any]
    """Where the cell's time went: ``parts_s`` (launch, imports, process_group, build, warmup, measured,
    extra_steps, profile, result, teardown from rank 0's phase marks, and machine_probe; a cell without
    a result has ``job`` and machine_probe), ``total_s`` (their sum), ``measured_share``, ``basis``."""
    machine_probe_s: dict[str, float]
    """CPU only: ``{"before", "after"}``, the normaliser workload timed around the cell
    (:mod:`harness.measure.machine_probe`)."""
    rounds: dict[str, Any]
    """``--rounds N`` only: ``n``, ``order``, ``seed``, ``medians_s`` (each round's median step, in round
    order), ``chosen_round`` (the median round, whose measurements the record holds), ``ci_s``,
    ``ci_coverage``, ``spread_pct`` (the median's order-statistic interval when recorded;
    :mod:`harness.run.rounds`), ``machine_probe_s`` and ``wall_s`` of every round."""
    nsys: dict[str, Any]
    """Under Nsight Systems only: ``tool`` (nsys's version), ``report`` (the one read back), ``measured_steps``, ``ranks`` (per
    rank: ``report``, ``ranges``, ``windows``, ``window_s``, ``steps_total``, ``steps_in_window``,
    ``phases`` {phase: {count, total_s}} inside the window, ``kernels``, ``nccl_kernels``),
    ``processes_ended_after`` (nsys processes still alive after the job, ended by the harness),
    ``problem`` (why the capture cannot be trusted, or None), ``attempts`` (per capture: ``report``,
    ``hung``: nsys made no progress for ``--nsys-wait`` seconds after rank 0 was done and was ended,
    ``report_wait_s``: seconds from then to the job's end, ``wall_s``, ``processes_ended_after``; a second
    attempt only after a hang) and ``seconds_lost`` (a hung first capture's wait plus the whole retry)."""


class CellMetrics(WorkerMetrics, CalibratedMfuMetrics, RunMetrics, total=False):
    """``record["metrics"]`` of a ``kind: "cell"`` record."""



def metric_keys() -> frozenset[str]:
    """Every top-level key a cell record's ``metrics`` may hold."""
    return CellMetrics.__required_keys__ | CellMetrics.__optional_keys__
