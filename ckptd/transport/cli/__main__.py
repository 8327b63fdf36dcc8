"""``python -m ckptd.transport.cli``: the same as ``ckptctl``."""

import sys

from ckptd.transport.cli.main import main

sys.exit(main())
