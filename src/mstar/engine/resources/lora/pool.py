"""The device tier: adapter slots on the accelerator, filled one copy per target."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch

from .layout import SlotLayout
from .spec import LoraSpec
from .store import LoadedAdapter


class LoraDevicePool:
    """Slots for adapters on one device, laid out like the host tier's copies.

    Per target, one slab [slots, block] whose row is the target's block as layout.py lays it out for
    the host tier too, so a held adapter's target moves in one copy. Slots are reused least recently
    activated first, never one the running batch needs. ranks[target] is [slots, layers, slices]: each
    slot's real rank per module (0 where it has none), which the kernels compute instead of max_rank;
    all targets' ranks lie in one tensor, so an activation moves them in one copy.
    """

    def __init__(
        self,
        spec: LoraSpec,
        slots: int,
        device: torch.device | str = "cpu",
        rank: int = 0,
        world_size: int = 1,
        dtype: torch.dtype | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError(f"a pool needs at least one slot, not {slots}")
        self.layout = SlotLayout(spec, rank, world_size, dtype or spec.dtype)
        self.spec, self.rank, self.world_size, self.dtype = spec, rank, world_size, self.layout.dtype
        self.device = torch.device(device)
        self.slabs: dict[str, torch.Tensor] = {}
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        for name, t in self.layout.targets.items():
            slab = torch.zeros(slots, t.nbytes // self.dtype.itemsize, dtype=self.dtype, device=self.device)
            self.slabs[name] = slab
            self.a[name], self.b[name] = t.split(slab[:, : t.numel])
        self.scaling = torch.zeros(slots, dtype=torch.float32, device=self.device)
        grids = {name: (t.target.layers, t.target.slices) for name, t in self.layout.targets.items()}
        width = sum(n * s for n, s in grids.values())
        self._ranks = torch.zeros(slots, width, dtype=torch.int32, device=self.device)
        # Where each row is written before its copy: pinned, so the copy waits on nothing queued (from pageable
        # memory the driver may wait for the stream first). A row rewritten before its last copy landed is
        # only ever rewritten by a later activation of the slot, whose copy follows on the same stream.
        self._staged_ranks = torch.zeros(slots, width, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self.ranks: dict[str, torch.Tensor] = {}
        at = 0
        for name, (n, s) in grids.items():
            self.ranks[name] = self._ranks[:, at : at + n * s].unflatten(1, (n, s))
            at += n * s
        self._names: list[str | None] = [None] * slots
        self._versions: list[object] = [None] * slots
        self._written: list[set[str]] = [set() for _ in range(slots)]  # targets each slot has weights in
        self._recent: OrderedDict[int, None] = OrderedDict((k, None) for k in range(slots))
        self._in_flight: list[tuple[torch.cuda.Event, LoadedAdapter]] = []
        self.copies = 0
        self.fills = 0
        self.bytes_moved = 0

    @property
    def slots(self) -> int:
        return len(self._names)

    def slot_of(self, name: str) -> int | None:
        """The slot holding name, or None."""
        try:
            return self._names.index(name)
        except ValueError:
            return None

    def resident(self) -> list[str | None]:
        """Each slot's adapter name, None for an empty slot."""
        return list(self._names)

    def activate(self, adapter: LoadedAdapter, keep: Iterable[str] = ()) -> int:
        """The slot holding adapter, copying it in (one copy per target it has, one fill per target it
        lacks where the slot's last adapter had weights) unless it is already there. keep names the
        adapters the running batch uses, whose slots are never taken."""
        slot = self.slot_of(adapter.name)
        if slot is not None and self._versions[slot] == adapter.version:
            self._recent.move_to_end(slot)
            return slot
        if slot is None:
            slot = self._free_slot(set(keep))
        self._check(adapter)
        asynchronous = False
        for name, slab in self.slabs.items():
            if name not in adapter.a:
                if name in self._written[slot]:  # no weights of the last adapter may leak into this one
                    slab[slot].zero_()
                    self.fills += 1
                continue
            block = adapter.blocks.get(name)
            pairs = [(slab[slot, : block.numel()], block)] if block is not None else \
                [(self.a[name][slot], adapter.a[name]), (self.b[name][slot], adapter.b[name])]
            for dst, src in pairs:
                dst.copy_(src, non_blocking=src.is_pinned())
                asynchronous |= self.device.type == "cuda" and src.is_pinned()
                self.copies += 1
                self.bytes_moved += src.numel() * src.element_size()
        self._written[slot] = set(adapter.a)
        self._staged_ranks[slot] = self._rank_row(adapter)
        self._ranks[slot].copy_(self._staged_ranks[slot], non_blocking=self.device.type == "cuda")
        self._hold_until_copied(adapter if asynchronous else None)
        self.scaling[slot] = adapter.scaling
        self._names[slot], self._versions[slot] = adapter.name, adapter.version
        self._recent.move_to_end(slot)
        return slot

    def _rank_row(self, adapter: LoadedAdapter) -> torch.Tensor:
        """adapter's ranks laid out as a row of the ranks tensor: 0 for targets it lacks, max_rank for one
        it has without ranks (built by hand)."""
        row = torch.zeros(self._ranks.shape[1], dtype=torch.int32)
        at = 0
        for name, view in self.ranks.items():
            n = view[0].numel()
            if name in adapter.a:
                ranks = adapter.ranks.get(name)
                row[at : at + n] = ranks.flatten() if ranks is not None else self.spec.max_rank
            at += n
        return row

    def _hold_until_copied(self, adapter: LoadedAdapter | None) -> None:
        """Keep an adapter whose copies are still in flight referenced until they land: the host tier
        may drop it meanwhile, and its pinned buffer must outlive the transfer."""
        self._in_flight = [(event, a) for event, a in self._in_flight if not event.query()]
        if adapter is not None:
            event = torch.cuda.Event()
            event.record()
            self._in_flight.append((event, adapter))

    def deactivate(self, name: str) -> None:
        """Free name's slot (its weights stay until the slot is reused, and are then overwritten)."""
        slot = self.slot_of(name)
        if slot is not None:
            self._names[slot], self._versions[slot] = None, None
            self._recent.move_to_end(slot, last=False)

    def _free_slot(self, keep: set[str]) -> int:
        for slot in self._recent:  # least recent first; empty slots were moved to the front
            if self._names[slot] is None or self._names[slot] not in keep:
                return slot
        raise RuntimeError(f"all {self.slots} slots hold adapters the running batch needs: {sorted(keep)}")

    def _check(self, adapter: LoadedAdapter) -> None:
        for name, a in adapter.a.items():
            if name not in self.a:
                raise ValueError(f"adapter {adapter.name!r}: target {name} is not one of this pool's")
            b, ranks = adapter.b[name], adapter.ranks.get(name)
            if ranks is not None and (ranks.shape != self.ranks[name].shape[1:] or ranks.min() < 0
                                      or ranks.max() > self.spec.max_rank):
                raise ValueError(f"adapter {adapter.name!r}: target {name}'s ranks are {list(ranks.shape)} from "
                                 f"{ranks.min()} to {ranks.max()}, this pool's are {list(self.ranks[name].shape[1:])}"
                                 f" from 0 to max_rank {self.spec.max_rank}")
            if a.shape != self.a[name].shape[1:] or b.shape != self.b[name].shape[1:] or a.dtype != self.dtype:
                raise ValueError(
                    f"adapter {adapter.name!r}: target {name} is {a.dtype} {list(a.shape)} / {list(b.shape)}, this "
                    f"pool's slots are {self.dtype} {list(self.a[name].shape[1:])} / {list(self.b[name].shape[1:])}"
                    " (another max_rank, rank or world size?)"
                )
