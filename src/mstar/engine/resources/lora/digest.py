"""adapter_digest: one hash of everything an adapter serves, the root of its prefix-cache keys."""

from __future__ import annotations

import json
import mmap
from collections.abc import Iterator
from contextlib import contextmanager

import blake3

from .checkpoint import Checkpoint
from .safetensors_header import TensorEntry
from .spec import ConvertKeys

# Bumped whenever what the digest covers changes, so old and new digests never collide.
DOMAIN = b"mstar-lora adapter digest v1\0"


@contextmanager
def mapped(checkpoint: Checkpoint) -> Iterator[mmap.mmap]:
    """The weights file mapped copy-on-write: writable for torch.frombuffer, never written back.

    Never closed here: torch.frombuffer keeps a reference to the map but no buffer export, so
    closing it would leave any tensor view still alive (one held by a traceback, say) pointing
    at unmapped memory. The mapping goes when its last reference does.
    """
    with open(checkpoint.weights, "rb") as f:
        if checkpoint.size == 0:
            raise checkpoint.refusal(["the file is empty"])
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    if len(mm) != checkpoint.size:
        raise checkpoint.refusal(["the file changed size while it was read"])
    yield mm


def adapter_digest(checkpoint: Checkpoint, convert_keys: ConvertKeys, mm: mmap.mmap | None = None) -> bytes:
    """The BLAKE3 digest of every module's name, role, dtype, shape and scaling, in name order, and of
    their bytes in that order.

    So it is the same on every node, rank and world size whatever the file's tensor order, and
    changes with any served byte or scaling.
    """
    if mm is None:
        with mapped(checkpoint) as mm:
            return adapter_digest(checkpoint, convert_keys, mm)
    data = data_digest(checkpoint, convert_keys, mm)
    manifest = []
    scalings = checkpoint.scalings(convert_keys)
    for module, roles in sorted(checkpoint.modules(convert_keys).items()):
        scaling = scalings[module].hex()
        manifest += [[module, role, e.dtype, list(e.shape), scaling] for role, e in sorted(roles.items())]
    head = json.dumps(manifest).encode()
    return blake3.blake3(DOMAIN + len(head).to_bytes(8, "little") + head + data).digest()


def data_digest(checkpoint: Checkpoint, convert_keys: ConvertKeys, mm: mmap.mmap) -> bytes:
    """The BLAKE3 of the tensors' bytes in name order. Runs that lie in the file in that order (all
    of them, for a file safetensors wrote) are hashed as one range, on every core, GIL released."""
    order = [e for _, roles in sorted(checkpoint.modules(convert_keys).items()) for _, e in sorted(roles.items())]
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    view = memoryview(mm)
    try:
        for start, stop in _runs(order):
            h.update(view[start:stop])
    finally:
        view.release()
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
