#!/usr/bin/env python3
"""`python -m bench pages` (bench/pages.py): the store's data path alone (no CRIU, no daemon)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.cli import entry

sys.exit(entry("pages"))
