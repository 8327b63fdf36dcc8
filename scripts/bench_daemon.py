#!/usr/bin/env python3
"""`python -m bench daemon` (bench/daemon.py): what the daemon adds over running CRIU directly."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.cli import entry

sys.exit(entry("daemon"))
