#!/usr/bin/env python3
"""`python -m bench migrate` (bench/migrate.py): migration between two daemons against raw CRIU."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.cli import entry

sys.exit(entry("migrate"))
