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
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any, Literal

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
from .checkpoint import Checkpoint, open_checkpoint
from .digest import adapter_digest, hash_runs, hash_stream
from .digest import manifest as digest_manifest
from .folds import Folds
from .header_json import no_collection
from .host_memory import HostBuffers
from .layout import SlotLayout
from .memory import tensor_checkpoint
from .plan import Plan, host_bytes, plan
from .reader import Scatter, fingerprints, land, landed_runs, landing_ranges, lay_out, read_layout
from .spec import LoraSpec

VERIFIED = 4096  # digests whose runs' fingerprints a store keeps (a few KB each for an 8B adapter)

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
    ranks[target] is [target layers, slices] int32, each module's real rank (0 where there is none),
    which the kernels compute instead of max_rank; an adapter without it is taken at max_rank.
    """

    name: str
    digest: bytes | None
    rank: int
    scaling: float
    a: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor]
    blocks: Mapping[str, torch.Tensor] = field(default_factory=dict, repr=False)
    ranks: Mapping[str, torch.Tensor] = field(default_factory=dict, repr=False)
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
        max_bytes: int | None = None,
        verify: Literal["fingerprint", "digest"] = "fingerprint",
    ) -> None:
        if verify not in ("fingerprint", "digest"):
            raise ValueError(f"verify is fingerprint or digest, not {verify!r}")
        if pin and not torch.cuda.is_available():
            raise ValueError("pin=True page-locks host memory for CUDA, and CUDA is not available")
        self.layout = SlotLayout(spec, rank, world_size, dtype or spec.dtype)
        self.spec, self.rank, self.world_size, self.dtype = spec, rank, world_size, self.layout.dtype
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.max_bytes = max_bytes
        self._held: OrderedDict[str, LoadedAdapter | None] = OrderedDict()
        self._sizes: dict[str, int] = {}  # what each held name takes, as its hold said
        self._reading: dict[str, tuple[bytes | None, Future[LoadedAdapter]]] = {}  # name -> (digest, read)
        self._buffers = HostBuffers(self.pin)
        self._staging = HostBuffers(pin=False, spare=1)  # what reads pass through, never pinned
        self._lock = threading.Lock()
        self.verify = verify
        # (digest, header identity) -> (manifest, each run's fingerprint), from a read that hashed every byte
        self._verified: OrderedDict[tuple[bytes, object], tuple[bytes, tuple[int, ...]]] = OrderedDict()

    # --- what is held: hold and drop alone decide it -------------------------------------

    def hold(self, name: str, keep: Iterable[str] = (), nbytes: int | None = None) -> bool:
        """Make name the most recent adapter held, dropping the least recent past capacity, but
        none named in keep (which may hold the tier past capacity for a while). True when it was
        not held, so its copy is the caller's to read in.

        With a byte budget (max_bytes), nbytes is what name's copy takes (host_bytes, known from its
        check and the same on every rank; None keeps what an earlier hold said), and the least recent
        are dropped too while the bytes held exceed the budget: still from the hold calls alone, never
        from what has been read.
        """
        with self._lock:
            new = name not in self._held
            if new:
                self._held[name] = None
            self._held.move_to_end(name)
            if nbytes is not None or new:
                self._sizes[name] = nbytes or 0
            over = len(self._held) - self.spec.capacity
            excess = sum(self._sizes.values()) - self.max_bytes if self.max_bytes is not None else 0
            if over > 0 or excess > 0:
                keep = keep if isinstance(keep, (set, frozenset)) else set(keep)
                for old in [n for n in self._held if n != name and n not in keep]:
                    if over <= 0 and excess <= 0:
                        break
                    del self._held[old]
                    over, excess = over - 1, excess - self._sizes.pop(old)
            return new

    def drop(self, name: str) -> None:
        with self._lock:
            self._held.pop(name, None)
            self._sizes.pop(name, None)
        self.trim()

    def trim(self) -> None:
        """Give back the memory of copies no longer used: host buffers no tensor views are unmapped
        (and unpinned), but for two kept for the next reads while the store holds anything. The store
        does this at every drop; an engine calls it when it lets go of adapters it took with get."""
        spare = 2 if len(self) else 0
        self._buffers.trim(spare)
        self._staging.trim(min(spare, 1))

    @property
    def held_bytes(self) -> int:
        """The bytes the held names take, as their holds said (copies in or not)."""
        with self._lock:
            return sum(self._sizes.values())

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
        with open_checkpoint(path, name) as ckpt:
            return self._read(ckpt, digest)

    def read_tensors(self, name: str, tensors: Mapping[str, torch.Tensor], config: Any = None,
                     digest: bytes | None = None) -> LoadedAdapter:
        """read for an adapter pushed from memory: a state dict in any layout the spec reads, with its
        config (adapter_config.json's fields, or a peft LoraConfig) unless its tensors carry alphas.
        The tensors are read, never written, so the copy rebuilt after an eviction is the first one."""
        return self._read(tensor_checkpoint(name, tensors, config), digest)

    def _read(self, ckpt: Checkpoint, digest: bytes | None) -> LoadedAdapter:
        with no_collection():  # a header never seen: tens of thousands of objects, none cyclic
            refuse_misfits(self.spec, ckpt)
            p = plan(ckpt, self.layout)
            ckpt.scalings(self.spec.convert_keys)
        try:
            if digest is None:  # this rank's shard alone, unverified
                folds = p.folds(ckpt.scalings(self.spec.convert_keys))
                blocks = read_layout(p, folds, ckpt.data, self._buffers, self._staging)
            else:
                blocks, folds = self._read_verified(ckpt, p, digest)
        except ValueError as e:
            refused = ckpt.refusal([str(e)])
        else:
            refused = None
        if refused is not None:  # raised anew, out here: the failed read's frames, and the buffer they hold, go
            raise refused
        views = {t: self.layout.targets[t].split(block) for t, block in blocks.items()}
        a = {t: ab[0] for t, ab in views.items()}
        b = {t: ab[1] for t, ab in views.items()}
        return LoadedAdapter(ckpt.name, digest, p.rank, folds.scaling, a, b, blocks, p.ranks)

    def _read_verified(self, ckpt: Checkpoint, p: Plan, digest: bytes) -> tuple[dict[str, torch.Tensor], Folds]:
        """The weights that hash to digest, or a ValueError. The first read under a digest reads every byte
        once, in chunks it hashes and lays this rank's pieces out of as they pass (alpha tensors' values
        too, so the scalings are the hashed ones), and keeps each run's fingerprint, taken where the run
        landed; later reads under the digest read only this rank's runs and check their fingerprints
        where they landed (fingerprint.py). Memory stays the layout's and two chunks, whatever the file."""
        conv = self.spec.convert_keys
        key = (digest, ckpt.header.identity)  # the plan follows from the header and this store's layout
        with self._lock:
            known = self._verified.get(key)
        if known is not None and self.verify == "fingerprint":
            scalings = ckpt.scalings(conv)
            if known[0] != digest_manifest(ckpt, conv):
                raise ValueError(_changed(ckpt, "its names, shapes or scalings differ from those that hashed to "
                                                "its digest"))
            folds = p.folds(scalings)
            try:
                return read_layout(p, folds, ckpt.data, self._buffers, self._staging, known[1]), folds
            except ValueError as e:
                raise ValueError(_changed(ckpt, str(e))) from None
        landing = land(p, self._buffers, self._staging)
        alphas = [(e.start, e.nbytes, memoryview(bytearray(e.nbytes))) for e in ckpt.alpha_entries(conv)]
        runs = landed_runs(p, landing)
        visit = Scatter([*landing_ranges(runs), *alphas])
        source = ckpt.data
        if ckpt.tensors is None and source.read(len(ckpt.header.prefix), 0) != ckpt.header.prefix:
            raise ValueError("its header changed since it was read: the file was rewritten in place")
        data = hash_stream(source, hash_runs(ckpt, conv), visit=visit)
        hashed = ckpt.with_alphas({at: bytes(v) for at, _, v in alphas})  # the alphas as they were hashed
        found = adapter_digest(hashed, conv, data=data)
        if found != digest:
            raise ValueError(f"its weights digest to {found.hex()[:16]}, not the {digest.hex()[:16]} it was "
                             f"checked with: {_changed(ckpt)}")
        prints = fingerprints(runs)  # before anything is laid out over the runs (folds write in place)
        folds = p.folds(hashed.scalings(conv))
        blocks = lay_out(p, landing, folds)
        with self._lock:
            self._verified[key] = (digest_manifest(hashed, conv), prints)
            while len(self._verified) > VERIFIED:
                self._verified.popitem(last=False)
        return blocks, folds

    def load(self, name: str, path: str | os.PathLike[str], digest: bytes | None = None) -> LoadedAdapter:
        """Hold name and read it from path unless its copy is in.

        A copy read under another digest than the one given is not its copy: the file changed and
        was checked again, so it is read again. A read already under way is joined only if it reads
        under the same digest; one under another is let land first. The hold says the bytes the copy
        takes (from the header), so a byte budget holds through load as through hold.
        """
        try:
            ckpt = open_checkpoint(path, name)
        except ValueError:
            self.hold(name)
            raise
        with ckpt:
            self.hold(name, nbytes=host_bytes(ckpt, self.layout))
            return self._load(ckpt, digest)

    def _load(self, ckpt: Checkpoint, digest: bytes | None) -> LoadedAdapter:
        name = ckpt.name
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
            adapter = self._read(ckpt, digest)
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


def _changed(ckpt: Checkpoint, why: str | None = None) -> str:
    what = "the file changed since" if ckpt.tensors is None else "the tensors changed since they were pushed"
    return what if why is None else f"{why}: {what}"
