"""Running cells: the sweep loop, one torchrun job per cell, the per-rank worker and its train step."""
