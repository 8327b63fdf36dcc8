#!/usr/bin/env python3
"""`python -m bench meta` (bench/meta.py): per-page metadata of a dump (peak RSS growth)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.cli import entry

sys.exit(entry("meta"))
