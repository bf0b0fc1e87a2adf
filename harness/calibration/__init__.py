"""Calibration: one store (:mod:`.store`) and what is measured into it (matmul, collectives, workload)."""
