"""Fingerprints of the bytes a read copies, so a read with a digest need not hash every byte again.

The first read of an adapter under its digest hashes every byte (BLAKE3, as digest.py says) and, from
the very bytes that hashed, where they landed, takes a fingerprint of each run the plan reads:
xxHash's XXH3, keyed by a seed drawn once per process, at many GB/s a core. A later read under that
digest and plan (after an eviction, say) reads only its own runs, fingerprints them where they landed,
and is refused if any differs. So every rank checks only its share, and what is served is still what
hashed to the digest.

What that guarantees: against a file changed by accident or by a writer racing the read (rewritten
in place, cut, a torn write, tensors stepped by an optimizer) a run that differs is caught but with
odds of 2^-64. XXH3 is not a cryptographic hash: against someone who can write the adapter's files
and means to slip weights past the check it is a speed bump, the seed being unknown to them, not a
proof; such a deployment reads with LoraAdapterStore(verify="digest"), which hashes every byte of
every read with BLAKE3.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import xxhash

SEED = int.from_bytes(os.urandom(8), "little")  # per process: fingerprints are never shared or stored


def fingerprint(data: memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data, SEED)


def of_parts(parts: Sequence[memoryview]) -> int:
    """The fingerprint of parts' bytes one after another: a run as it landed in its places."""
    if len(parts) == 1:
        return fingerprint(parts[0])
    h = xxhash.xxh3_64(seed=SEED)
    for p in parts:
        h.update(p)
    return h.intdigest()
