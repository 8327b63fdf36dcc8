"""Configuration of the core, passed in as a value (never read from a global)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CoreConfig:
    node: str
    daemon_pid: int
    work_dir: Path
    """CRIU logs of each operation go to ``work_dir/<operation id>/``."""
    output_dir: Path
    """Default home of restored trees' stdout when it was a pipe or terminal."""
    zombie_wait_s: float = 5.0
    """How long a restore waits for a killed process's zombie to be reaped."""
    keep_work_dirs: int = 20
    recovery_wait_s: float = 60.0
    """At start-up, how long to wait for a CRIU left by a killed daemon to let go of a tree."""
    file_capture_limit: int = 8 << 30
    """Largest file the tree writes whose content a checkpoint captures (bytes)."""
    file_capture_oversize: str = "refuse"
    """A written file over ``file_capture_limit``: ``refuse`` the dump (naming it), or
    ``skip`` its capture (said in the checkpoint; a restore then needs it at its size)."""
    files_dir_max_files: int = 10_000
    """Most files a dump captures under its output directories (``--files DIR``): more
    refuses the dump (a DIR given one level too high would copy a home directory)."""
    shared_files: str = "keep"
    """A captured file that a process outside the tree holds open for writing (or maps
    writable) at a restore: ``keep`` it as it is (the restore says so), ``refuse`` the
    restore naming that process, or ``roll-back`` it to the checkpoint's content all the
    same (the version found kept aside)."""
    ghost_limit: int = 256 << 20
    """Largest ghost file a dump takes (bytes): a file the tree holds open or mapped after it
    was deleted, its content copied into the images (PyTorch's shared memory: DataLoader
    batches, tensors shared with ``torch.multiprocessing``). A larger one refuses the dump,
    naming it and this setting."""
    ghost_total_limit: int = 1 << 30
    """Largest total of one dump's ghost files (bytes, allocated): over it the dump is
    refused before anything is frozen, naming the files and the setting."""
    ghost_uid_limit: int = 4 << 30
    """Largest total of the ghost files of one uid's trees in the dumps under way at once."""
    aside_keep: int = 3
    """After a restore that succeeded: copies kept aside of each file put back beyond the
    newest ``aside_keep`` are removed, and those older than ``aside_max_age_s`` (0: none)."""
    aside_max_age_s: float = 7 * 86400
    tcp_outside_peers: str = "restore"
    """A TCP connection to a peer outside the tree (a database, a metrics server): ``restore``
    it established where this node has its local address (closed, with the restore's event
    naming it, where it does not), or ``refuse`` the dump before anything is frozen (unless
    ``--tcp-close``)."""
    stream_restore: bool = True
    """CRIU reads a restore's images from the store as they are verified (no image directory
    written first) when it can (``Criu.can_stream_restore``); not for restores into a
    container, nor a migration's staged images."""
    jobs_cgroup: str = "/ckptd-jobs"
    """Where a tree restored for the daemon itself (or for a caller in the daemon's own
    cgroup) gets a cgroup of its own, ``<jobs_cgroup>/<name or id>-<op>`` (cgroup v2 path);
    empty: such trees stay in the daemon's cgroup. A caller's own restores go into its cgroup."""
