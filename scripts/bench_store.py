#!/usr/bin/env python3
"""`python -m bench store` (bench/store.py): the checkpoint store against raw CRIU and zstd."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.cli import entry

sys.exit(entry("store"))
