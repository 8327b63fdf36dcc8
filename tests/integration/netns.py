"""Two network namespaces joined by a veth pair, for two-node tests on one machine.

``TwoNodes`` makes namespaces ``a`` and ``b`` (named under /var/run/netns, as ``ip netns``
does) with a veth pair between them, 10.231.X.1/24 in ``a`` and 10.231.X.2/24 in ``b``, and
``lo`` up in each. Everything is done through pyroute2's netlink API, not the ``ip`` command.

``in_netns(name)`` is a ``preexec_fn`` that moves a child into a namespace's network
namespace *only*. ``ip netns exec`` would also give the child a mount namespace of its own
(to bind /etc/netns/NAME files), and CRIU refuses to dump a task whose mount namespace is not
its own, so tests must not use it for the processes they checkpoint.

Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import itertools
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from pyroute2 import IPRoute, NetNS, netns

NETNS_RUN_DIR = "/var/run/netns"
CLONE_NEWNET = 0x40000000
SUBNET_PREFIX = "10.231"
PREFIX_LEN = 24

_instances = itertools.count()


@dataclass(frozen=True)
class Node:
    """One end of a ``TwoNodes`` pair: the network namespace's name and its IPv4 address."""

    name: str
    address: str


def netns_path(name: str) -> str:
    """Where ``ip netns`` / pyroute2 bind-mount the namespace called ``name``."""
    return os.path.join(NETNS_RUN_DIR, name)


def _setns_function() -> Callable[[int, int], int]:
    """``setns(fd, nstype)``: ``os.setns`` (Python >= 3.12), else libc's through ctypes.

    Resolved in the parent, so the child after fork only makes the call. Returns 0 on
    success; raises ``OSError`` on failure."""
    os_setns: Callable[[int, int], None] | None = getattr(os, "setns", None)
    if os_setns is not None:
        native = os_setns

        def call_os(fd: int, nstype: int) -> int:
            native(fd, nstype)
            return 0

        return call_os

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc_setns = libc.setns
    libc_setns.argtypes = [ctypes.c_int, ctypes.c_int]
    libc_setns.restype = ctypes.c_int

    def call_libc(fd: int, nstype: int) -> int:
        if libc_setns(fd, nstype) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns: {os.strerror(err)}")
        return 0

    return call_libc


def in_netns(name: str) -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen`` that moves the child into the network
    namespace ``name`` (``/var/run/netns/NAME``) and into no other namespace: the child
    keeps our mount, pid, user, ... namespaces.

    The child only opens the namespace file, calls setns(CLONE_NEWNET) and closes the fd;
    everything else (the path, the setns function) is prepared here, before the fork. A
    missing namespace makes ``Popen`` raise (``SubprocessError`` or ``OSError``)."""
    path = netns_path(name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no network namespace {name!r} ({path} does not exist)")
    setns = _setns_function()
    flags = os.O_RDONLY | os.O_CLOEXEC

    def enter() -> None:
        fd = os.open(path, flags)
        try:
            setns(fd, CLONE_NEWNET)
        finally:
            os.close(fd)

    return enter


def _unique_octet() -> int:
    """The third octet X of 10.231.X.0/24: differs between instances of this process (for
    the first 256) and, most likely, between concurrent test processes."""
    return (os.getpid() * 7 + next(_instances)) % 256


class TwoNodes:
    """Context manager: network namespaces ``a`` and ``b`` joined by a veth pair.

    On entry it creates both namespaces (unique names ``ckptd-a-<pid>-<hex>`` and
    ``ckptd-b-...``), a veth pair whose ends are moved into ``a`` and ``b``, the addresses
    ``10.231.X.1/24`` (``a``) and ``10.231.X.2/24`` (``b``), and brings the veth ends and
    ``lo`` up in each. On exit (also after a failed test, or when entry failed half way) it
    deletes the veth if it is still in our namespace and removes both namespaces; the veth
    goes with the last process left in either namespace.

    ``a`` and ``b`` are ``Node(name, address)``; ``subnet`` is ``10.231.X.0/24``."""

    def __init__(self) -> None:
        """Pick the names and addresses; nothing is created before ``__enter__``."""
        tag = f"{os.getpid()}-{secrets.token_hex(3)}"
        octet = _unique_octet()
        self.a = Node(f"ckptd-a-{tag}", f"{SUBNET_PREFIX}.{octet}.1")
        self.b = Node(f"ckptd-b-{tag}", f"{SUBNET_PREFIX}.{octet}.2")
        self.subnet = f"{SUBNET_PREFIX}.{octet}.0/{PREFIX_LEN}"
        short = secrets.token_hex(4)  # interface names: at most 15 characters
        self.veth_a = f"ckva{short}"
        self.veth_b = f"ckvb{short}"
        self._namespaces: list[str] = []

    def __enter__(self) -> TwoNodes:
        """Create the namespaces, the veth pair and the addresses; undo it all on failure."""
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Remove everything ``__enter__`` created."""
        self.close()

    def _create(self) -> None:
        for node in (self.a, self.b):
            self._namespaces.append(node.name)  # first: create() may fail half way
            netns.create(node.name)
        with IPRoute() as ipr:
            ipr.link("add", ifname=self.veth_a, kind="veth", peer=self.veth_b)
            for ifname, node in ((self.veth_a, self.a), (self.veth_b, self.b)):
                (index,) = ipr.link_lookup(ifname=ifname)
                ipr.link("set", index=index, net_ns_fd=node.name)
        for ifname, node in ((self.veth_a, self.a), (self.veth_b, self.b)):
            with NetNS(node.name, flags=0) as ns:
                (lo,) = ns.link_lookup(ifname="lo")
                ns.link("set", index=lo, state="up")
                (index,) = ns.link_lookup(ifname=ifname)
                ns.addr("add", index=index, address=node.address, prefixlen=PREFIX_LEN)
                ns.link("set", index=index, state="up")

    def close(self) -> None:
        """Best effort, idempotent: delete a veth end left in our namespace, remove the
        namespaces this instance created."""
        with contextlib.suppress(Exception), IPRoute() as ipr:
            for ifname in (self.veth_a, self.veth_b):
                for index in ipr.link_lookup(ifname=ifname):
                    ipr.link("del", index=index)
        while self._namespaces:
            name = self._namespaces.pop()
            with contextlib.suppress(Exception):
                netns.remove(name)

    def __repr__(self) -> str:
        """Names and addresses, for assertion messages."""
        return f"TwoNodes(a={self.a}, b={self.b})"
