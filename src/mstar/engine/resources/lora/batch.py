"""A step's tokens grouped by slot, once, for every layer and target the kernels run on.

The tokens are sorted by slot (those with no adapter, -1, first) and the sorted order is cut into
tiles of at most block_m tokens of one slot each. There are at most cdiv(tokens, block_m) +
min(slots, tokens) tiles whatever the slots, so a launch grid sized by that bound is fixed for a
given token count, and everything here is built by tensor ops on the tokens' device: no host
synchronisation, so a forward that uses it can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Tokens per tile. Decode steps (a token per request, up to a few hundred requests) have a token or
# a few per slot, so a short tile wastes least; prefill has long runs of one adapter, where a tall
# tile reads each slot's weights once for many tokens.
DECODE_BLOCK_M = 16
PREFILL_BLOCK_M = 64
PREFILL_TOKENS = 512  # a step of at least this many tokens is taken for a prefill


@dataclass(frozen=True, eq=False)
class LoraBatch:
    """The per-step metadata: each token's slot, and tiles of the tokens sorted by slot.

    Tile i covers sorted positions tile_start[i] : tile_end[i] (at most block_m of them), all using
    slot tile_slot[i]; a tile past the last one holds slot -1 and is skipped. Slots past the pool's
    count are refused where the slots are on the CPU and assert on the device otherwise.
    """

    slots: torch.Tensor  # [tokens] the slot of each token, -1 for none
    order: torch.Tensor  # [tokens] token indices sorted by slot
    tile_slot: torch.Tensor  # [tiles] int32
    tile_start: torch.Tensor  # [tiles] int32, a position in order
    tile_end: torch.Tensor  # [tiles] int32: where the tile's segment (one slot's tokens) ends
    block_m: int
    slot_count: int  # the pool's slots it was built for: no slot at or past it is read

    @classmethod
    def build(cls, slots: torch.Tensor, slot_count: int, block_m: int | None = None) -> LoraBatch:
        """The metadata of one step's per-token slots, for a pool of slot_count slots. block_m is
        chosen from the token count unless given (decode- and prefill-shaped steps differ)."""
        if slots.dim() != 1:
            raise ValueError(f"slots must be one slot per token, not a tensor of shape {list(slots.shape)}")
        tokens, device = slots.numel(), slots.device
        if block_m is None:
            block_m = PREFILL_BLOCK_M if tokens >= PREFILL_TOKENS else DECODE_BLOCK_M
        slots = slots.to(torch.int64)
        _check_slots(slots, slot_count)
        order = torch.argsort(slots, stable=True)
        # Per slot (index 0 is "none"): its tokens, where its run starts in order, its tiles.
        counts = torch.zeros(slot_count + 1, dtype=torch.int64, device=device)
        counts.scatter_add_(0, slots + 1, torch.ones_like(slots))
        ends = torch.cumsum(counts, 0)[1:]
        counts = counts[1:]
        starts = ends - counts
        tiles = (counts + block_m - 1) // block_m
        last_tile = torch.cumsum(tiles, 0)  # one past each slot's last tile
        bound = -(-tokens // block_m) + min(slot_count, tokens)
        i = torch.arange(bound, device=device)
        seg = torch.searchsorted(last_tile, i, right=True)  # the slot whose tiles include tile i
        used = seg < slot_count
        seg = seg.clamp(max=slot_count - 1)
        first = last_tile[seg] - tiles[seg]
        tile_start = starts[seg] + (i - first) * block_m
        return cls(
            slots=slots,
            order=order,
            tile_slot=torch.where(used, seg, -1).to(torch.int32),
            tile_start=tile_start.to(torch.int32),
            tile_end=ends[seg].to(torch.int32),
            block_m=block_m,
            slot_count=slot_count,
        )

    @property
    def tokens(self) -> int:
        return self.slots.numel()

    def check(self, slots: int, device: torch.device) -> None:
        """Refuse a pool it cannot be read with: one of fewer slots (its slots could lie past the slabs) or on
        another device."""
        if self.slot_count > slots or self.slots.device != device:
            raise ValueError(f"a LoraBatch built for {self.slot_count} slots on {self.slots.device} cannot be read "
                             f"with a pool of {slots} slots on {device}")


def _check_slots(slots: torch.Tensor, slot_count: int) -> None:
    ok = ((slots >= -1) & (slots < slot_count)).all()
    if slots.device.type == "cpu":
        if not ok:
            bad = sorted(set(slots[(slots < -1) | (slots >= slot_count)].tolist()))
            raise ValueError(f"slots {bad} are not -1 or one of this pool's {slot_count} slots")
    else:  # a check on the host would wait for the device
        torch._assert_async(ok, f"slots must be -1 or one of this pool's {slot_count} slots")
