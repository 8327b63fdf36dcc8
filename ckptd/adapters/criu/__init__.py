"""CRIU through its RPC interface (``criu swrk``)."""

from ckptd.adapters.criu.swrk import CriuSwrk

__all__ = ["CriuSwrk"]
