"""A container init standing in for ``ckptctl run`` where the daemon is not involved:
``pid1.py -- CMD ...`` starts CMD in a session of its own and exits with its status;
``pid1.py --wait-for PATH -- CMD ...`` first waits for PATH to exist (the test moves the
pid namespace's pid counter meanwhile, as the daemon would for ``ckptctl run``);
``pid1.py --adopt [--decoys N]`` starts nothing and waits for a child to be given to it (a
tree restored into its pid namespace is reparented to it when CRIU exits), then exits with its
status; with ``--decoys N`` it first starts N sleeping children, holding the lowest pids as
``ckptctl run``'s own threads would.
Either way it reaps every other orphan, as an init must."""

import os
import sys
import time


def status(wait_status: int) -> int:
    if os.WIFSIGNALED(wait_status):
        return 128 + os.WTERMSIG(wait_status)
    return os.WEXITSTATUS(wait_status)


def main() -> int:
    args = sys.argv[1:]
    job = 0
    decoys: list[int] = []
    if args[:1] == ["--adopt"]:
        for _ in range(int(args[2]) if args[1:2] == ["--decoys"] else 0):
            pid = os.fork()
            if pid == 0:
                while True:
                    time.sleep(3600)
            decoys.append(pid)
        print(f"pid1: {os.getpid()} waiting for a child (decoys {decoys})", file=sys.stderr,
              flush=True)
    else:
        if args[:1] == ["--wait-for"]:
            while not os.path.exists(args[1]):
                time.sleep(0.01)
            args = args[2:]
        if args[:1] == ["--"]:
            args = args[1:]
        job = os.fork()
        if job == 0:
            os.setsid()
            os.execvp(args[0], args)
    while True:
        try:
            pid, wait_status = os.wait()
        except ChildProcessError:
            time.sleep(0.02)
            continue
        if job == 0 and pid not in decoys:
            job = pid  # the first adopted child is the job
        if pid == job:
            for decoy in decoys:
                os.kill(decoy, 9)
            return status(wait_status)


if __name__ == "__main__":
    sys.exit(main())
