#!/usr/bin/env python3
"""`python -m bench lazy` (bench/lazy.py): lazy restore, time until the job runs, against raw
CRIU's lazy-pages."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.cli import entry

sys.exit(entry("lazy"))
