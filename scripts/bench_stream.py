#!/usr/bin/env python3
"""`python -m bench stream` (bench/stream.py): ways for a dump's pages to reach ckptd."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.cli import entry

sys.exit(entry("stream"))
