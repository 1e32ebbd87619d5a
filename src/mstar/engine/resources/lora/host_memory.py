"""Host buffers of exactly the size asked, pinned by registering them with CUDA when asked."""

from __future__ import annotations

import math
import mmap
import weakref

import torch

# Offsets of the views carved from one buffer are multiples of this, so each starts aligned
# for any dtype and vector load.
ALIGN = 256
HUGE_PAGE = 2 * 1024 * 1024


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def host_buffer(nbytes: int) -> torch.Tensor:
    """An uint8 buffer of nbytes, zeroed by the kernel.

    Mapped anonymously with transparent huge pages: a fresh 84 MB buffer then costs a few
    hundred faults, not twenty thousand, which were most of a read's time. The mapping ends
    when the last view of the buffer dies.
    """
    mm = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        mm.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mm, dtype=torch.uint8)


def pin_for(owner: object, tensor: torch.Tensor) -> None:
    """Page-lock the whole buffer under tensor until owner is collected.

    cudaHostRegister on the buffer rather than torch's pinned allocator, which rounds each block
    up to a power of two (an 84 MB adapter would hold 128 MB). The registration ends with owner,
    whose collection runs before its tensors (and so the mapping) go: a view kept past it only
    loses the pinning, never points at unregistered freed memory.
    """
    from torch.cuda import _pin_memory_utils

    storage = tensor.untyped_storage()
    _pin_memory_utils.pin_memory(storage.data_ptr(), storage.nbytes())
    weakref.finalize(owner, _pin_memory_utils.unpin_memory, storage.data_ptr())


def carve(buf: torch.Tensor, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Views of buf, one per shape, at ALIGN-aligned offsets in order."""
    out, at = [], 0
    for shape in shapes:
        nbytes = math.prod(shape) * dtype.itemsize
        out.append(buf[at : at + nbytes].view(dtype).view(shape))
        at += aligned(nbytes)
    return out


def buffer_bytes(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> int:
    return sum(aligned(math.prod(shape) * dtype.itemsize) for shape in shapes)


def target_block(a_shape: tuple[int, ...], b_shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, int]:
    """(b's offset, the block's length), in elements, of one target's a then b as carve lays them out.

    The device pool lays each slot out the same way, so a target moves in one copy.
    """
    a_bytes = math.prod(a_shape) * dtype.itemsize
    b_start = aligned(a_bytes) // dtype.itemsize
    return b_start, b_start + math.prod(b_shape)
