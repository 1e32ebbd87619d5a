"""adapter_digest: one hash of everything an adapter serves, the root of its prefix-cache keys."""

from __future__ import annotations

import json
import mmap
from collections.abc import Iterator

import blake3

from .checkpoint import Checkpoint
from .keys import ConvertKeys
from .safetensors_header import TensorEntry

# Bumped whenever what the digest covers changes, so old and new digests never collide.
DOMAIN = b"mstar-lora adapter digest v1\0"


def adapter_digest(checkpoint: Checkpoint, convert_keys: ConvertKeys, mm: mmap.mmap | None = None) -> bytes:
    """The BLAKE3 digest of every module's name, role, dtype, shape and scaling, in name order, and of
    their bytes in that order.

    So it is the same on every node, rank and world size whatever the file's tensor order, and
    changes with any served byte or scaling.
    """
    data = data_digest(checkpoint, convert_keys, checkpoint.mapping() if mm is None else mm)
    manifest = []
    scalings = checkpoint.scalings(convert_keys)
    for module, keys in sorted(checkpoint.modules(convert_keys).items()):
        scaling = scalings[module].hex()
        manifest += [[module, role, e.dtype, list(e.shape), scaling] for role, e in sorted(keys.roles.items())]
    head = json.dumps(manifest).encode()
    return blake3.blake3(DOMAIN + len(head).to_bytes(8, "little") + head + data).digest()


def data_digest(checkpoint: Checkpoint, convert_keys: ConvertKeys, mm: mmap.mmap) -> bytes:
    """The BLAKE3 of the tensors' bytes in name order. Runs that lie in the file in that order (all
    of them, for a file safetensors wrote) are hashed as one range, on every core, GIL released."""
    order = [e for _, keys in sorted(checkpoint.modules(convert_keys).items()) for _, e in sorted(keys.roles.items())]
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
