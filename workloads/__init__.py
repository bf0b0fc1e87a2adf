"""Reference workloads: GPT-style decoders at named sizes and their seeded, learnable data."""

from workloads.data import MarkovData
from workloads.model import GPT
from workloads.sizes import SIZES, ModelSize, get_size

__all__ = ["SIZES", "ModelSize", "get_size", "GPT", "MarkovData"]
