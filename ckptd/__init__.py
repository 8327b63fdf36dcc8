"""ckptd: transparent checkpoint/restore of Linux (and CUDA) process trees.

The public Python API is re-exported here; everything else is internal.
"""

from ckptd.errors import CkptdError

__version__ = "0.1.0"
__all__ = ["CkptdError", "__version__"]
