"""Adapters: ckptd's ports implemented against the outside world (CRIU, /proc, disks).

Each maps the foreign errors it meets into ``ckptd.errors`` at its edge, keeping the cause.
"""
