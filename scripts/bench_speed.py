#!/usr/bin/env python3
"""`python -m bench speed` (bench/speed.py): ckptd against raw CRIU, side by side.

Options as before: --sizes --kinds --dir --also K=V --small N (and --json PATH); CKPTD_CRIU
names the CRIU of the raw runs and of the daemons.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.cli import entry

sys.exit(entry("speed"))
