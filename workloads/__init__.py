"""Reference workloads: pre-norm decoders of the gpt2 and llama3 families at named sizes, and their seeded, learnable data."""

from workloads.data import MarkovData
from workloads.model import Decoder
from workloads.sizes import ARCHS, FAMILIES, SIZES, ModelSize, get_size

__all__ = ["ARCHS", "FAMILIES", "SIZES", "ModelSize", "get_size", "Decoder", "MarkovData"]
