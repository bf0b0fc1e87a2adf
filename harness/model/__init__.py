"""An analytic performance model of a cell: memory, communication, pipeline bubble, step time.

It predicts from the cell's configuration alone (plus calibration data the planner looks up
and hands in: the model reads no files and imports nothing above it), so the same code
checks itself against a measured sweep (``predicted`` beside ``metrics`` in every record)
and extrapolates to device counts this machine does not have (``harness plan --device``).

* :mod:`inventory`: every parameter tensor, and what one rank holds of it under pp x tp x FSDP;
* :mod:`memory`: model-state bytes per rank, activations, predicted peak;
* :mod:`comm`: every collective call one rank issues per step, with its bytes (nccl-tests sizes);
* :mod:`compute`: compute time from the workload and matmul calibrations;
* :mod:`comm_fit`: collective time from a comm calibration (alpha-beta fit);
* :mod:`predict`: ``record.predicted`` of a planned cell;
* :mod:`step_time`: compute + exposed communication + pipeline bubble;
* :mod:`hardware`: datasheet peaks, memory and interconnect bandwidths for what-if planning;
* :mod:`whatif`: rank strategies at a device count (the report prints the model's measured error beside them).
"""
