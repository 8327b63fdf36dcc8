"""The host's processes, read from /proc."""

from ckptd.adapters.procfs.cudafacts import ProcCudaFacts
from ckptd.adapters.procfs.node import ProcNodeInspector
from ckptd.adapters.procfs.proctable import ProcFsTable
from ckptd.adapters.procfs.runtime import RuntimeProbe
from ckptd.adapters.procfs.stdio import LocalStdioProvider

__all__ = ["LocalStdioProvider", "ProcCudaFacts", "ProcFsTable", "ProcNodeInspector",
           "RuntimeProbe"]
