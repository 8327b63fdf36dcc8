"""``python -m ckptd.transport.cli``: the same as ``ckptctl``."""

from ckptd.transport.cli.main import program

program()
