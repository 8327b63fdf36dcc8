#!/usr/bin/env python3
"""Prototype of issue #12's flow with a real OCI runtime (runc or crun) and raw CRIU run inside
the containers (ckptd.adapters.criu.containers): a job in container A is checkpointed, A is
deleted, container B is started, the job is restored into B's namespaces, cgroups and root
filesystem, continues bit for bit, and B exits with the job's status.

    scripts/proto_container_restore.py [--work DIR] [--steps N] [--interval-ms MS]
        [--dump-after-step K] [--exit-status S] [--no-preload] [--job writer|tcp] [--podman]
        [--json]

Root, CRIU >= 4.1 and runc or crun ($CKPTD_TEST_RUNTIME picks one). Prints what it saw of the
restored job and the timings; exits 0 when everything held. See docs/design/containers.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.containers.flow import Flow, FlowError


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, help="working directory (default: a temporary one)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--interval-ms", type=int, default=40)
    parser.add_argument("--dump-after-step", type=int, default=30)
    parser.add_argument("--exit-status", type=int, default=7)
    parser.add_argument("--no-preload", action="store_true",
                        help="CRIU from the container's root filesystem (nsenter --mount), not "
                        "loaded from the node then moved in")
    parser.add_argument("--job", choices=("writer", "tcp"), default="writer",
                        help="writer: log + state file + stdout; tcp: a loopback TCP pair in "
                        "the container (dumped established)")
    parser.add_argument("--podman", action="store_true",
                        help="podman run --rootfs instead of runc/crun with a bundle")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckptd-proto-") as tmp:
        flow = Flow(work=args.work or Path(tmp), steps=args.steps, interval_ms=args.interval_ms,
                    dump_after_step=args.dump_after_step, exit_status=args.exit_status,
                    preload=not args.no_preload, job=args.job,
                    engine="podman" if args.podman else "oci")
        try:
            seen = flow.run()
        except FlowError as exc:
            print(f"proto: stopped: {exc}", file=sys.stderr)
            print(json.dumps({"timings": flow.timings, **flow.facts}, indent=1, default=str))
            return 1
    restored = seen["restored"]
    assert isinstance(restored, dict)
    ok = (restored["ppid_is_b_init"] and all(restored["namespaces_equal"].values())
          and restored["cgroup_equal"] and restored["root_equal"]
          and seen["b_exit_status"] == args.exit_status and seen["stdout_equal"]
          and seen["log_equal"] and seen["state_equal"])
    if args.json:
        print(json.dumps(seen, indent=1, default=str))
    else:
        t = seen["timings"]
        assert isinstance(t, dict)
        print(f"job pid {seen['a_job_ns_pid']} in A -> pid {restored['ns_pid']} in B; "
              f"parent: B's init: {restored['ppid_is_b_init']}")
        print(f"namespaces equal to B's init's: {restored['namespaces_equal']}; cgroup: "
              f"{restored['cgroup_equal']}; root: {restored['root_equal']}")
        print(f"B exited {seen['b_exit_status']} (job's: {args.exit_status}); stdout, log, "
              f"state bit for bit: {seen['stdout_equal']}, {seen['log_equal']}, "
              f"{seen['state_equal']}")
        print("timings: " + ", ".join(f"{k} {v:.3f}" for k, v in t.items()))
    print("proto: OK" if ok else "proto: FAILED", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
