#!/usr/bin/env python3
"""`python -m bench rss` (bench/rss.py): the daemon's memory over many dumps."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.cli import entry

sys.exit(entry("rss"))
