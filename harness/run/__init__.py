"""Running cells: the sweep loop, a fork server forking each cell's ranks (torchrun for multi-node and nsys), the per-rank worker and its train step."""
