"""adapter_digest: one hash of everything an adapter serves, the root of its prefix-cache keys."""

from __future__ import annotations

import ctypes
import json
import mmap
from collections.abc import Iterator

import blake3
import torch

from .checkpoint import Checkpoint
from .keys import ConvertKeys
from .safetensors_header import TensorEntry

# Bumped whenever what the digest covers changes, so old and new digests never collide.
DOMAIN = b"mstar-lora adapter digest v1\0"
HASH_ON_EVERY_CORE = blake3.blake3.AUTO


def adapter_digest(checkpoint: Checkpoint, convert_keys: ConvertKeys, mm: mmap.mmap | None = None, *,
                   threads: int = HASH_ON_EVERY_CORE) -> bytes:
    """The BLAKE3 digest of every module's name, role, dtype, shape and scaling, in name order, and of
    their bytes in that order.

    So it is the same on every node, rank and world size whatever the file's tensor order, and
    changes with any served byte or scaling.
    """
    if mm is None and checkpoint.tensors is None:
        mm = checkpoint.mapping()
    data = data_digest(checkpoint, convert_keys, mm, threads)
    head = manifest(checkpoint, convert_keys)
    return blake3.blake3(DOMAIN + len(head).to_bytes(8, "little") + head + data).digest()


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


def data_digest(checkpoint: Checkpoint, convert_keys: ConvertKeys, mm: mmap.mmap | None,
                threads: int = HASH_ON_EVERY_CORE) -> bytes:
    """The BLAKE3 of the tensors' bytes in name order. Runs that lie in the file in that order (all
    of them, for a file safetensors wrote) are hashed as one range, on threads cores, GIL released;
    pushed tensors are hashed one by one, from their own memory."""
    key = ("hash order", convert_keys)
    if key not in checkpoint.header.memo:
        modules = sorted(checkpoint.modules(convert_keys).items())
        order = [e for _, keys in modules for _, e in sorted(keys.roles.items())]
        checkpoint.header.memo[key] = order, list(_runs(order))
    order, runs = checkpoint.header.memo[key]
    h = blake3.blake3(max_threads=threads)
    if checkpoint.tensors is not None:
        for e in order:
            _update(h, checkpoint.tensor(e))
        return h.digest()
    view = memoryview(mm)
    try:
        for start, stop in runs:
            h.update(view[start:stop])
    finally:
        view.release()
    return h.digest()


def _update(h: blake3.blake3, t: torch.Tensor) -> None:
    """h fed t's bytes as a file holds them: straight from its memory where it is a contiguous CPU tensor."""
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.contiguous().cpu()
    h.update(memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B"))


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
