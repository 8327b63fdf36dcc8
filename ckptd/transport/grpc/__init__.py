"""The gRPC face of ckptd: servicers, caller identity, status codes (chosen only here)."""
