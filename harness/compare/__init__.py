"""Compare runs: is B slower than A, and since when.

* :mod:`~harness.compare.verdicts`: ``harness compare`` and the gate's judgement: records paired by
  fingerprint, one verdict per pair (PASS, REGRESSION, IMPROVED, INCONCLUSIVE, NOT COMPARABLE, ...)
  and the exit code;
* :mod:`~harness.compare.stats`: its statistics, pure (ratio of medians, bootstrap CI, Mann-Whitney U);
* :mod:`~harness.compare.cell_normaliser`: ``--normalize calibration``'s normaliser per cell, from the
  run's matmul timings, and how far it can be trusted;
* :mod:`~harness.compare.run_diff`: ``harness diff A B``, every metric of two runs side by side;
* :mod:`~harness.compare.run_history` and :mod:`~harness.compare.changepoint`: ``harness history``,
  each cell's throughput over runs and the runs where it stepped.
"""
