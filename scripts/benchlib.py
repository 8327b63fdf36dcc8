"""What the benchmark scripts shared, now bench.common (``python -m bench``; ADR 0023): kept
for callers that import ``benchlib`` from scripts/."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (
    CRIU,
    CRIU_FLAGS,
    command_of,
    dir_bytes,
    kill,
    timed,
    wait_gone,
)

__all__ = ["CRIU", "CRIU_FLAGS", "command_of", "dir_bytes", "kill", "timed", "wait_gone"]
