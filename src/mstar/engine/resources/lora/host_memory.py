"""Host buffers of exactly the size asked, pinned by registering them with CUDA, reused once unviewed."""

from __future__ import annotations

import mmap
import sys
import threading
import weakref

import torch

HUGE_PAGE = 2 * 1024 * 1024


class HostBuffers:
    """The host buffers one store maps, reused once no tensor views them.

    A buffer is an anonymous mapping with transparent huge pages (a fresh 84 MB one costs a few
    hundred faults, not twenty thousand), registered with CUDA when pinned: cudaHostRegister of
    exactly its bytes, not torch's pinned allocator, which rounds each block up to a power of two
    (128 MB held for an 84 MB adapter). Once every view of a buffer is gone (its adapter dropped
    and collected, its copies landed) a read of the same size writes into it again: memory
    already mapped, faulted and registered. At most `spare` unviewed buffers are kept.
    """

    def __init__(self, pin: bool, spare: int = 2) -> None:
        self.pin, self.spare = pin, spare
        self._maps: list[mmap.mmap] = []
        self._lock = threading.Lock()
        if pin:
            weakref.finalize(self, _unpin_all, self._maps)

    def take(self, nbytes: int, exact: bool = True) -> tuple[torch.Tensor, bool]:
        """A uint8 buffer of nbytes and whether it is fresh (zeroed by the kernel) or reused (not). Not
        exact, it may be an unviewed one up to twice as large (a staging buffer, whose size varies)."""
        size = max(nbytes, 1)
        with self._lock:
            unviewed = [i for i in range(len(self._maps)) if self._unviewed(i)]
            fits = sorted((len(self._maps[i]), i) for i in unviewed
                          if len(self._maps[i]) == size or (not exact and size <= len(self._maps[i]) <= 2 * size))
            if fits:
                return torch.frombuffer(self._maps[fits[0][1]], dtype=torch.uint8), False
            for i in reversed(unviewed[self.spare :]):  # drop what no read of these sizes will want
                self._discard(i)
            mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if size >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
                mm.madvise(mmap.MADV_HUGEPAGE)
            buf = torch.frombuffer(mm, dtype=torch.uint8)
            if self.pin:
                from torch.cuda import _pin_memory_utils

                _pin_memory_utils.pin_memory(buf.data_ptr(), size)
            self._maps.append(mm)
            return buf, True

    def trim(self, spare: int) -> None:
        """Unmap the buffers no tensor views but spare of them (unpinning each first), so memory goes
        back to the system once the adapters using it are gone."""
        with self._lock:
            unviewed = [i for i in range(len(self._maps)) if self._unviewed(i)]
            for i in reversed(unviewed[spare:]):
                self._discard(i)

    @property
    def nbytes(self) -> int:
        """Every buffer mapped, viewed or spare."""
        with self._lock:
            return sum(len(m) for m in self._maps)

    def _unviewed(self, i: int) -> bool:
        # torch.frombuffer's storage holds a reference to the map; with none, only this list
        # and the call's argument do, and no tensor can be looking at it.
        return sys.getrefcount(self._maps[i]) == 2

    def _discard(self, i: int) -> None:
        mm = self._maps.pop(i)
        if self.pin:  # before the mapping goes, which dropping the last reference does
            _unpin(mm)


def _unpin(mm: mmap.mmap) -> None:
    from torch.cuda import _pin_memory_utils

    _pin_memory_utils.unpin_memory(torch.frombuffer(mm, dtype=torch.uint8).data_ptr())


def _unpin_all(maps: list[mmap.mmap]) -> None:
    for mm in maps:
        _unpin(mm)
