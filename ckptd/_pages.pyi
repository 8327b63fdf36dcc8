from collections.abc import Container

from typing_extensions import Buffer

PAGE_SIZE: int
HASH_SIZE: int
MAX_THREADS: int

def hash_pages(
    buffer: Buffer, seed: int, *, zero_ref: bool = False, threads: int = 0
) -> bytes: ...
def verify_pages(buffer: Buffer, hashes: Buffer, seed: int, *, threads: int = 0) -> int: ...
def plan_new(
    refs: Buffer, known: Container[bytes], fresh: set[bytes]
) -> tuple[list[bytes], list[tuple[int, int]]]: ...
def compress_frame(data: Buffer, level: int) -> bytes: ...
def cpu_count() -> int: ...
