"""``ckptctl``, the command-line client of ckptd (entry point: :func:`main.main`)."""
