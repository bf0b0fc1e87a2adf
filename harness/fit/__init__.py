"""``harness fit``: a cell's memory measured as one rank of N devices, on the one device here.

torch's fake process-group backend returns from every collective at once while every tensor
keeps its real sharded shape, so one process can play rank r of world N. Each distinct rank
role (:mod:`roles`: a pipeline's first, middle and last stages, FSDP ranks whose shards differ)
runs in its own process (:mod:`role`), which builds the real ``parallelize()`` and runs real
training steps; :mod:`cell` gathers the roles, compares them with the analytic model and
writes one ``kind: "fit"`` record per cell. No time or throughput is measured: the
collectives are fake.
"""
