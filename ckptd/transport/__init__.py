"""Transports: how callers reach the CheckpointService (gRPC, the ckptctl CLI)."""
