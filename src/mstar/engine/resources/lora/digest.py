"""adapter_digest: one hash of everything an adapter serves, the root of its prefix-cache keys."""

from __future__ import annotations

import bisect
import json
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import blake3

from .checkpoint import Checkpoint
from .keys import ConvertKeys
from .safetensors_header import TensorEntry
from .source import FileSource, Source
from .stream import BLOCK, stream_hash

# Bumped whenever what the digest covers changes, so old and new digests never collide.
DOMAIN = b"mstar-lora adapter digest v1\0"
HASH_ON_EVERY_CORE = blake3.blake3.AUTO


def adapter_digest(checkpoint: Checkpoint, convert_keys: ConvertKeys, *, threads: int = HASH_ON_EVERY_CORE,
                   data: bytes | None = None) -> bytes:
    """The BLAKE3 digest of every module's name, role, dtype, shape and scaling, in name order, and of
    their bytes in that order.

    So it is the same on every node, rank and world size whatever the file's tensor order, and
    changes with any served byte or scaling. The bytes' own digest is data where given (a read that
    hashed them as they passed, hash_stream), else they are read from the checkpoint's open file or its
    pushed tensors, never mapped: a file cut meanwhile ends the hash with a refusal, not a SIGBUS.
    """
    data = data_digest(checkpoint, convert_keys, threads) if data is None else data
    return head_hash(checkpoint, convert_keys).copy().update(data).digest()


def head_hash(checkpoint: Checkpoint, convert_keys: ConvertKeys) -> blake3.blake3:
    """The digest's hash with the domain and manifest taken in, before the data's digest: once per header and
    scalings, copied for each adapter (of a recipe's, only the data's digest differs)."""
    scalings = checkpoint.scalings(convert_keys)
    key = ("digest head", convert_keys, tuple(scalings.items()))
    if key not in checkpoint.header.memo:
        head = manifest(checkpoint, convert_keys)
        checkpoint.header.memo[key] = blake3.blake3(DOMAIN + len(head).to_bytes(8, "little") + head)
    return checkpoint.header.memo[key]


def file_digest(checkpoint: Checkpoint, convert_keys: ConvertKeys, threads: int = 1) -> bytes:
    """adapter_digest of a checkpoint read from its open file in one pass over its bytes (stream.py): the
    header's bytes compared with those it was parsed from, the alpha tensors' values taken from the bytes
    hashed (so the manifest's scalings are those that hashed), and the file as it was opened once hashed,
    in size and modification time. So a file rewritten in place while it is checked is refused, never given
    a digest of bytes from before and after the write."""
    source = checkpoint.source
    alphas = [(e.start, memoryview(bytearray(e.nbytes))) for e in checkpoint.alpha_entries(convert_keys)]
    try:
        data = stream_hash(source, hash_runs(checkpoint, convert_keys), checkpoint.header.prefix, threads,
                           visit=_Take(alphas) if alphas else None, block=BLOCK if threads == 1 else CHUNK)
        why = source.changes()
        if why is not None:
            raise ValueError(why)
    except ValueError as e:
        raise checkpoint.refusal([str(e)]) from None
    hashed = checkpoint.with_alphas({at: v.tobytes() for at, v in alphas}) if alphas else checkpoint
    return adapter_digest(hashed, convert_keys, data=data)


def streams_from_file(checkpoint: Checkpoint) -> bool:
    """Whether file_digest reads this checkpoint: one read from its own open file, not pushed tensors."""
    return checkpoint.tensors is None and isinstance(checkpoint.source, FileSource)


class _Take:
    """A visit copying out the bytes of small tensors (by start) as the hash's blocks pass: only those a block
    overlaps are looked at (a kohya file holds hundreds of alphas, its hash thousands of blocks)."""

    def __init__(self, into: list[tuple[int, memoryview]]) -> None:
        self.into = sorted(into, key=lambda item: item[0])
        self.starts = [start for start, _ in self.into]

    def __call__(self, at: int, view: memoryview) -> None:
        stop = at + len(view)
        for i in range(max(bisect.bisect_right(self.starts, at) - 1, 0), len(self.into)):
            start, out = self.into[i]
            if start >= stop:
                break
            lo, hi = max(start, at), min(start + len(out), stop)
            if lo < hi:
                out[lo - start : hi - start] = view[lo - at : hi - at]


def manifest(checkpoint: Checkpoint, convert_keys: ConvertKeys) -> bytes:
    """Every module's name, role, dtype, shape and scaling, in name order: once per header and scalings."""
    scalings = checkpoint.scalings(convert_keys)
    key = ("manifest", convert_keys, tuple(scalings.items()))
    if key not in checkpoint.header.memo:
        rows = []
        for module, keys in sorted(checkpoint.modules(convert_keys).items()):
            scaling = scalings[module].hex()
            rows += [[module, role, e.dtype, list(e.shape), scaling] for role, e in sorted(keys.roles.items())]
        checkpoint.header.memo[key] = json.dumps(rows).encode()
    return checkpoint.header.memo[key]


def hash_runs(checkpoint: Checkpoint, convert_keys: ConvertKeys) -> list[tuple[int, int]]:
    """The byte ranges the data digest covers, in the order it covers them: every module's tensors in name
    order, runs that lie in the file in that order (all of them, for a file safetensors wrote) merged."""
    key = ("hash order", convert_keys)
    if key not in checkpoint.header.memo:
        modules = sorted(checkpoint.modules(convert_keys).items())
        order = [e for _, keys in modules for _, e in sorted(keys.roles.items())]
        checkpoint.header.memo[key] = list(_runs(order))
    return checkpoint.header.memo[key]


def data_digest(checkpoint: Checkpoint, convert_keys: ConvertKeys, threads: int = HASH_ON_EVERY_CORE) -> bytes:
    """The BLAKE3 of the tensors' bytes in name order, read from the checkpoint's file or pushed tensors in
    chunks hashed on threads cores, GIL released."""
    try:
        return hash_stream(checkpoint.data, hash_runs(checkpoint, convert_keys), threads)
    except ValueError as e:
        raise checkpoint.refusal([str(e)]) from None


Visit = Callable[[int, memoryview], None]

# A source is hashed through two buffers of this, one filling while the other is hashed: small enough to
# stay in cache between the copy and the hash (measured here: 2 MB hashes 2.3x faster than through a
# mapping of the file, 8 MB 1.9x).
CHUNK = 2 << 20
_PREFETCH = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="mstar-lora-hash-read")
_BUFFERS = threading.local()


def hash_stream(source: Source, runs: list[tuple[int, int]], threads: int = HASH_ON_EVERY_CORE,
                visit: Visit | None = None) -> bytes:
    """The BLAKE3 of the runs' bytes read from source, the next chunk read while this one is hashed; each
    chunk is shown to visit(offset, bytes) first (a read lays its pieces out of the very bytes it hashes)."""
    h = blake3.blake3(max_threads=threads)
    chunks = [(at, min(CHUNK, stop - at)) for start, stop in runs for at in range(start, stop, CHUNK)]
    if not hasattr(_BUFFERS, "pair"):  # each hashing thread's own, kept: a fresh one faults on every page
        _BUFFERS.pair = (bytearray(CHUNK), bytearray(CHUNK))
    buffers = _BUFFERS.pair

    def fill(i: int) -> memoryview:
        at, n = chunks[i]
        view = memoryview(buffers[i % 2])[:n]
        source.read_into([view], at)
        return view

    pending = _PREFETCH.submit(fill, 0) if chunks else None
    try:
        for i in range(len(chunks)):
            view = pending.result()
            pending = _PREFETCH.submit(fill, i + 1) if i + 1 < len(chunks) else None
            if visit is not None:
                visit(chunks[i][0], view)
            h.update(view)
    finally:  # no read may still be filling a buffer once this returns
        if pending is not None:
            pending.exception()
    return h.digest()


def _runs(tensors: list[TensorEntry]) -> Iterator[tuple[int, int]]:
    """The tensors' byte ranges in order, adjacent ones merged."""
    start = stop = None
    for e in tensors:
        if e.start == stop:
            stop = e.stop
            continue
        if start is not None:
            yield start, stop
        start, stop = e.start, e.stop
    if start is not None:
        yield start, stop
