"""The CUDA driver's checkpoint API (``cuda.bindings.driver``, or the ``cuda-checkpoint``
utility as a fallback). Importing this package imports no CUDA library."""

from ckptd.adapters.cuda.driver import CudaDriverCheckpointer
from ckptd.adapters.cuda.support import bytes_to_uuid, uuid_to_bytes

__all__ = ["CudaDriverCheckpointer", "bytes_to_uuid", "uuid_to_bytes"]
