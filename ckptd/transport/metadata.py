"""Names of the gRPC metadata ckptd's server and clients share (no gRPC import: ``ckptctl``
reads them without grpcio, ``ckptd/transport/cli/wire.py``)."""

ERROR_KIND_KEY = "ckptd-error"
"""Trailing metadata key of a status the daemon chose (its value: the error's class name), so
that a client tells the daemon's own UNAVAILABLE (a peer daemon unreachable) from not reaching
the daemon at all."""
