"""adapter_digest: one hash of everything an adapter serves, the root of its prefix-cache keys."""

from __future__ import annotations

import json
import mmap
from collections.abc import Iterator
from contextlib import contextmanager

import blake3

from .checkpoint import Checkpoint, ConvertKeys

# Bumped whenever what the digest covers changes, so old and new digests never collide.
DOMAIN = b"mstar-lora adapter digest v1\0"


@contextmanager
def mapped(checkpoint: Checkpoint) -> Iterator[mmap.mmap]:
    """The weights file mapped copy-on-write: writable for torch.frombuffer, never written back."""
    with open(checkpoint.weights, "rb") as f:
        if checkpoint.size == 0:
            raise checkpoint.refusal(["the file is empty"])
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        if len(mm) != checkpoint.size:
            raise checkpoint.refusal(["the file changed size while it was read"])
        yield mm
    finally:
        try:
            mm.close()
        except BufferError:  # a tensor view still holds it; it closes when that view dies
            pass


def adapter_digest(checkpoint: Checkpoint, convert_keys: ConvertKeys, mm: mmap.mmap | None = None) -> bytes:
    """The BLAKE3 digest of every module's name, role, dtype, shape, bytes and scaling, in name order.

    So it is the same on every node, rank and world size whatever the file's tensor order, and
    changes with any served byte or scaling.
    """
    if mm is None:
        with mapped(checkpoint) as mm:
            return adapter_digest(checkpoint, convert_keys, mm)
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    h.update(DOMAIN)
    view = memoryview(mm)
    try:
        for module, roles in sorted(checkpoint.modules(convert_keys).items()):
            scaling = checkpoint.config.module_scaling(module)
            for role, e in sorted(roles.items()):
                head = json.dumps([module, role, e.dtype, list(e.shape), scaling.hex()]).encode()
                h.update(len(head).to_bytes(8, "little") + head)
                h.update(view[e.start : e.stop])
    finally:
        view.release()
    return h.digest()
