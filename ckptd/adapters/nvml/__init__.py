"""GPU inventory through NVML (``pynvml``, package nvidia-ml-py). Importing this package
imports no NVIDIA library."""

from ckptd.adapters.nvml.inventory import NvmlInventory

__all__ = ["NvmlInventory"]
