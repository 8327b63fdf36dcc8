"""``RecordingHooks``: CRIU's notifications (``CriuHooks``) recorded, one refused on demand."""

from __future__ import annotations

from ckptd.core.ports import CriuHooks


class RecordingHooks(CriuHooks):
    """Appends each notification's name (the hook's: ``"pre_dump"``, ``"post_restore"``, ...)
    to ``seen``, in order; the one named ``fail_on`` raises (RuntimeError), which makes CRIU
    abort the operation as a refusing hook does."""

    def __init__(self, fail_on: str = "") -> None:
        self.seen: list[str] = []
        self.fail_on = fail_on

    def only(self, *names: str) -> list[str]:
        """``seen``, keeping only ``names`` (a test's view of the notifications it checks)."""
        return [n for n in self.seen if n in names]

    def _note(self, name: str) -> None:
        self.seen.append(name)
        if name == self.fail_on:
            raise RuntimeError(f"hook {name} refuses")

    def pre_dump(self, pid: int) -> None:
        self._note("pre_dump")

    def network_lock(self, pid: int) -> None:
        self._note("network_lock")

    def post_dump(self, pid: int) -> None:
        self._note("post_dump")

    def network_unlock(self, pid: int) -> None:
        self._note("network_unlock")

    def criu_started(self, criu_pid: int) -> None:
        self._note("criu_started")

    def pre_restore(self, pid: int) -> None:
        self._note("pre_restore")

    def setup_namespaces(self, pid: int) -> None:
        self._note("setup_namespaces")

    def post_restore(self, pid: int) -> None:
        self._note("post_restore")

    def pre_resume(self, pid: int) -> None:
        self._note("pre_resume")

    def post_resume(self, pid: int) -> None:
        self._note("post_resume")
