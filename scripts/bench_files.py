#!/usr/bin/env python3
"""`python -m bench files` (bench/files.py): what capturing the files a job writes costs."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.cli import entry

sys.exit(entry("files"))
