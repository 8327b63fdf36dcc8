"""``python -m bench SUBCOMMAND [options]``."""

import sys

from bench.cli import main

sys.exit(main())
