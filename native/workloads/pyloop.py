#!/usr/bin/env python3
"""Deterministic pure-Python "training loop" workload for C/R tests.

A tiny linear regression trained by minibatch SGD over a fixed-seed dataset.
Each step runs a few minibatches (sampled by a fixed-seed PRNG) and prints
``step <i> <loss>`` with the full-dataset MSE formatted with 17 significant
digits (exact float round-trip).  After the last step it prints
``done <hex>``: a hash of the final parameters and PRNG state.

Standard library only.  Floats are accumulated with explicit loops (not
``sum()``, whose algorithm changed in Python 3.12) so output is stable.
"""

from __future__ import annotations

import argparse
import hashlib
import struct
import sys
import time

MASK64 = (1 << 64) - 1
N_SAMPLES = 64
N_FEATURES = 4
BATCH = 8
BATCHES_PER_STEP = 4
LR = 0.05


class XorShift64:
    def __init__(self, seed: int) -> None:
        self.state = (seed & MASK64) or 0x2545F4914F6CDD1D

    def next(self) -> int:
        x = self.state
        x ^= (x << 13) & MASK64
        x ^= x >> 7
        x ^= (x << 17) & MASK64
        self.state = x
        return x

    def uniform(self) -> float:
        """Float in [0, 1) with 53 random bits."""
        return (self.next() >> 11) * (1.0 / (1 << 53))


def make_dataset(rng: XorShift64) -> tuple[list[list[float]], list[float]]:
    w_true = [1.5, -2.0, 0.75, 3.25]
    b_true = -0.5
    xs: list[list[float]] = []
    ys: list[float] = []
    for _ in range(N_SAMPLES):
        x = [rng.uniform() * 2.0 - 1.0 for _ in range(N_FEATURES)]
        y = b_true
        for j in range(N_FEATURES):
            y += w_true[j] * x[j]
        y += (rng.uniform() - 0.5) * 0.2  # noise: the loss never reaches 0
        xs.append(x)
        ys.append(y)
    return xs, ys


def predict(w: list[float], b: float, x: list[float]) -> float:
    p = b
    for j in range(N_FEATURES):
        p += w[j] * x[j]
    return p


def mse(w: list[float], b: float, xs: list[list[float]], ys: list[float]) -> float:
    total = 0.0
    for x, y in zip(xs, ys, strict=True):
        err = predict(w, b, x) - y
        total += err * err
    return total / len(xs)


def sgd_step(
    rng: XorShift64, w: list[float], b: float, xs: list[list[float]], ys: list[float]
) -> float:
    """Runs BATCHES_PER_STEP minibatch updates in place on w; returns new b."""
    for _ in range(BATCHES_PER_STEP):
        gw = [0.0] * N_FEATURES
        gb = 0.0
        for _ in range(BATCH):
            k = rng.next() % N_SAMPLES
            err = predict(w, b, xs[k]) - ys[k]
            for j in range(N_FEATURES):
                gw[j] += err * xs[k][j]
            gb += err
        for j in range(N_FEATURES):
            w[j] -= LR * 2.0 * gw[j] / BATCH
        b -= LR * 2.0 * gb / BATCH
    return b


def sleep_ms(ms: int) -> None:
    # time.sleep() already resumes after EINTR with the remaining time (PEP 475).
    if ms > 0:
        time.sleep(ms / 1000.0)


def non_negative(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="pyloop",
        description="Deterministic SGD workload (prints 'step <i> <loss>' per step).",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--steps", type=non_negative, default=100, help="number of steps, 0 = forever"
    )
    parser.add_argument(
        "--interval-ms", type=non_negative, default=100, help="sleep between steps (ms)"
    )
    return parser.parse_args(argv)  # unknown flag: usage on stderr, exit 2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]

    rng = XorShift64(0x5059_4C4F_4F50)
    xs, ys = make_dataset(rng)
    w = [0.0] * N_FEATURES
    b = 0.0
    loss = mse(w, b, xs, ys)

    i = 1
    while args.steps == 0 or i <= args.steps:
        b = sgd_step(rng, w, b, xs, ys)
        loss = mse(w, b, xs, ys)
        sys.stdout.write(f"step {i} {loss:.17g}\n")
        sys.stdout.flush()
        if args.steps == 0 or i < args.steps:
            sleep_ms(args.interval_ms)
        i += 1

    state = struct.pack(f"<{N_FEATURES + 2}dQ", *w, b, loss, rng.state)
    digest = hashlib.blake2b(state, digest_size=8).hexdigest()
    sys.stdout.write(f"done {digest}\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
