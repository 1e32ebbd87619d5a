"""The host tier of the adapter pool: adapters read, sharded for this rank, and pinned.

An adapter's tensors are laid out exactly like one device slot (rank padded to the pool's
max_rank with zeros), so moving it onto the device is one copy per target.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from .check import (
    adapter_targets,
    as_linear,
    check_adapter_file,
    check_adapters,
    inspect_adapter,
    inspect_keys,
    misfit,
    refuse_misfits,
)
from .checkpoint import open_checkpoint
from .digest import adapter_digest
from .host_memory import HostBuffers
from .layout import SlotLayout
from .reader import read_layout
from .spec import LoraSpec

_HASHER = ThreadPoolExecutor(1, thread_name_prefix="mstar-lora-digest")

__all__ = [
    "LoadedAdapter",
    "LoraAdapterStore",
    "adapter_targets",
    "as_linear",
    "check_adapter_file",
    "check_adapters",
    "inspect_adapter",
    "inspect_keys",
    "misfit",
]


@dataclass(frozen=True, eq=False)
class LoadedAdapter:
    """One adapter, ready to copy into a slot.

    a[target] is [target layers, slices * max_rank, in] and b[target] is [target layers, out,
    max_rank], both already this rank's shard. A target the adapter does not touch is absent.
    digest is adapter_digest of the unsharded weights, so every rank agrees on it, computed as
    the API server computes the one it roots the adapter's prefix-cache keys in. It is verified
    against the file's bytes when read was given it; read without one (which then reads only
    this rank's shard) leaves it None, and such an adapter has no prefix-cache root.

    blocks[target] is the flat block a[target] and b[target] are views of, as a device slot lays it
    out, where the store read it so (one copy per target); an adapter built by hand may have none.
    """

    name: str
    digest: bytes | None
    rank: int
    scaling: float
    a: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor]
    blocks: Mapping[str, torch.Tensor] = field(default_factory=dict, repr=False)
    serial: int = field(default_factory=itertools.count().__next__, init=False, repr=False)

    @property
    def version(self) -> bytes | tuple[str, int]:
        """What these weights are: the digest where there is one, else this read alone. A device slot
        holding another version of the name must be copied again."""
        return self.digest if self.digest is not None else ("read", self.serial)

    @property
    def nbytes(self) -> int:
        """The bytes of its layout, which is all the host memory it holds."""
        return sum(t.nbytes for t in (*self.a.values(), *self.b.values()))


class LoraAdapterStore:
    """Adapters held in pinned host memory.

    Which adapters it holds follows from the hold calls alone, in their order: each makes an
    adapter the most recent, dropping the least recent past capacity but none the call's keep
    names. A held adapter's copy arrives later, by put, once read. So when a read lands or
    fails never changes what is held, and ranks that make the same calls hold the same set.
    """

    def __init__(
        self,
        spec: LoraSpec,
        rank: int = 0,
        world_size: int = 1,
        pin: bool | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if pin and not torch.cuda.is_available():
            raise ValueError("pin=True page-locks host memory for CUDA, and CUDA is not available")
        self.layout = SlotLayout(spec, rank, world_size, dtype or spec.dtype)
        self.spec, self.rank, self.world_size, self.dtype = spec, rank, world_size, self.layout.dtype
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._held: OrderedDict[str, LoadedAdapter | None] = OrderedDict()
        self._reading: dict[str, tuple[bytes | None, Future[LoadedAdapter]]] = {}  # name -> (digest, read)
        self._buffers = HostBuffers(self.pin)
        self._staging = HostBuffers(pin=False, spare=1)  # what reads pass through, never pinned
        self._lock = threading.Lock()

    # --- what is held: hold and drop alone decide it -------------------------------------

    def hold(self, name: str, keep: Iterable[str] = ()) -> bool:
        """Make name the most recent adapter held, dropping the least recent past capacity, but
        none named in keep (which may hold the tier past capacity for a while). True when it was
        not held, so its copy is the caller's to read in."""
        with self._lock:
            new = name not in self._held
            if new:
                self._held[name] = None
            self._held.move_to_end(name)
            over = len(self._held) - self.spec.capacity
            if over > 0:
                keep = keep if isinstance(keep, (set, frozenset)) else set(keep)
                for old in [n for n in self._held if n != name and n not in keep][:over]:
                    del self._held[old]
            return new

    def drop(self, name: str) -> None:
        with self._lock:
            self._held.pop(name, None)

    def put(self, adapter: LoadedAdapter) -> bool:
        """adapter's copy, kept if it is still held."""
        with self._lock:
            if adapter.name not in self._held:
                return False
            self._held[adapter.name] = adapter
            return True

    def get(self, name: str) -> LoadedAdapter | None:
        """The held copy of name, or None; recency is left as it is."""
        with self._lock:
            return self._held.get(name)

    def held(self) -> list[str]:
        """The names held, least recent first (copies in or not)."""
        with self._lock:
            return list(self._held)

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._held

    @property
    def nbytes(self) -> int:
        """Host bytes of the copies held, each exactly its layout."""
        with self._lock:
            return sum(a.nbytes for a in self._held.values() if a is not None)

    @property
    def mapped_bytes(self) -> int:
        """Host bytes mapped for copies: those held, those still viewed elsewhere, and a few spares
        kept for the next reads."""
        return self._buffers.nbytes

    # --- reading: outside the lock -------------------------------------------------------

    def read(self, name: str, path: str | os.PathLike[str], digest: bytes | None = None) -> LoadedAdapter:
        """path read, checked against the spec and sharded for this rank, without holding it: a
        caller can read outside whatever lock guards put. With digest, weights that digest
        otherwise are refused: the file changed since the adapter was checked and keyed, and
        serving it would put other weights under the same prefix-cache root, or different weights
        on different ranks."""
        # Checked again, not trusted from startup: the file may have changed since.
        ckpt = open_checkpoint(path, name)
        refuse_misfits(self.spec, ckpt)
        conv = self.spec.convert_keys
        # The hash (which releases the GIL) runs beside the copy; nothing is returned unless it matches.
        hashing = _HASHER.submit(adapter_digest, ckpt, conv) if digest is not None else None
        try:
            top, blocks = read_layout(ckpt, self.layout, self._buffers, self._staging)
        finally:
            found = hashing.result() if hashing else None
        if found != digest:
            raise ckpt.refusal([f"its weights digest to {found.hex()[:16]}, not the {digest.hex()[:16]} it was "
                                "checked with: the file changed since"])
        views = {t: self.layout.targets[t].split(block) for t, block in blocks.items()}
        a = {t: ab[0] for t, ab in views.items()}
        b = {t: ab[1] for t, ab in views.items()}
        return LoadedAdapter(name, digest, top, ckpt.scaling(conv), a, b, blocks)

    def load(self, name: str, path: str | os.PathLike[str], digest: bytes | None = None) -> LoadedAdapter:
        """Hold name and read it from path unless its copy is in.

        A copy read under another digest than the one given is not its copy: the file changed and
        was checked again, so it is read again. A read already under way is joined only if it reads
        under the same digest; one under another is let land first.
        """
        self.hold(name)
        while True:
            with self._lock:
                copy = self._held.get(name)
                if copy is not None and (digest is None or copy.digest == digest):
                    return copy
                reading = self._reading.get(name)
                if reading is None:
                    future: Future[LoadedAdapter] = Future()
                    self._reading[name] = (digest, future)
                    break
            theirs, other = reading
            if digest is None or theirs == digest:
                return other.result()
            wait([other])
        try:
            adapter = self.read(name, path, digest)
        except BaseException as e:
            with self._lock:
                del self._reading[name]
            future.set_exception(e)
            raise
        with self._lock:  # put and forget the read at once, so no later load reads it again
            if name in self._held:
                self._held[name] = adapter
            del self._reading[name]
        future.set_result(adapter)
        return adapter
