"""One pass over a weights file on the calling thread: each block read into a buffer of the thread's own,
then hashed there, while it is still in the core's cache.

The startup check hashes many files at once, one a worker: every core is busy hashing already, so a
second thread reading ahead of each hash only hands blocks from one core's cache to another's. Read and
hashed on one thread, a block is copied from the page cache once and hashed from cache (both GIL
released: os.preadv, and blake3's update of a buffer this large). The file's first bytes come in the
same pass: they are compared with the header the check parsed, so bytes of another header are never
hashed under this one's manifest.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable

import blake3

from .source import FileSource

# Small enough that a block is hashed from the core's cache (2 MB of L2 here) right after it is copied there,
# large enough that a read's system call is nothing beside it, and that the workers seldom wait on one
# another for the GIL between a read and a hash. Measured here, check_adapters over 200 files on two workers:
# 1 MB 6-9% faster than 256 KB (preadv and BLAKE3 alone, with no other Python, the same at both).
BLOCK = 1 << 20

# Every update but a run's last ends at a multiple of this many bytes hashed: BLAKE3 hashes 16 of its 1 KiB
# chunks at once only from a count of chunks hashed that 16 divides, so an update begun elsewhere hashes
# its first chunks a few at a time (6% slower here, with the data beginning past a header of any length).
ALIGN = 64 << 10

Visit = Callable[[int, memoryview], None]

_BUFFERS = threading.local()


def thread_block(nbytes: int = BLOCK) -> memoryview:
    """This thread's buffer of nbytes, kept for its next file: an anonymous mapping, so page-aligned, and
    faulted in once rather than on every file."""
    have = getattr(_BUFFERS, "block", None)
    if have is None or len(have) != nbytes:
        have = memoryview(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
        _BUFFERS.block = have
    return have


def stream_hash(source: FileSource, runs: list[tuple[int, int]], prefix: bytes, threads: int = 1,
                visit: Visit | None = None, block: int = BLOCK) -> bytes:
    """The BLAKE3 (on threads cores) of the runs' bytes of the open file, each shown to visit(offset,
    bytes) first. prefix, the bytes the header was parsed from (the file's first ones), is read in the
    same pass where the runs start right after it, and compared: ValueError if the file's differ (it was
    rewritten in place since), or if it ends before a run does."""
    h = blake3.blake3(max_threads=threads)
    skip = 0
    if runs and runs[0][0] == len(prefix):
        runs, skip = [(0, runs[0][1]), *runs[1:]], len(prefix)
    elif source.read(len(prefix), 0) != prefix:
        raise ValueError(HEADER_CHANGED)
    buf, hashed = thread_block(block), 0
    for start, stop in runs:
        at = start
        while at < stop:
            n = min(block, stop - at)
            lo = min(max(skip - at, 0), n)  # the header's bytes in this block: compared, not hashed
            trim = (hashed + n - lo) % ALIGN
            if at + n < stop and n - trim > lo:  # so the next update starts where the hash's tree is aligned
                n -= trim
            hashed += n - lo
            view = buf[:n]
            source.read_into([view], at, n)  # one preadv, or on from a short one; a refusal where the file ends
            if lo:
                if view[:lo].tobytes() != prefix[at : at + lo]:
                    raise ValueError(HEADER_CHANGED)
                view = view[lo:]
            if visit is not None:
                visit(at + lo, view)
            h.update(view)
            at += n
    return h.digest()


HEADER_CHANGED = "its header changed since it was read: the file was rewritten in place"
