#!/usr/bin/env python3
"""`python -m bench no-io-uring` (bench/no_io_uring.py): the cost of the io_uring filter."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.cli import entry

sys.exit(entry("no-io-uring"))
