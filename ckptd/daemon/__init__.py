"""The ckptd daemon: configuration, wiring (the composition root), serving, lifecycle."""
