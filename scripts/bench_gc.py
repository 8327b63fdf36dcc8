#!/usr/bin/env python3
"""`python -m bench gc` (bench/gc.py): GC compaction of a job that rewrites scattered memory."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.cli import entry

sys.exit(entry("gc"))
