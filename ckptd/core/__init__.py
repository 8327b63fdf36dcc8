"""The logic of ckptd: recipes for dump and restore over abstract ports.

Imports only ``ckptd.domain``, ``ckptd.errors`` and its own ports; never an adapter, gRPC,
CRIU's wire format or a GPU library.
"""
