"""Host buffers of exactly the size asked, pinned by registering them with CUDA when asked."""

from __future__ import annotations

import weakref

import torch

# Offsets of the views carved from one buffer are multiples of this, so each starts aligned
# for any dtype and vector load.
ALIGN = 256


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """An uninitialised uint8 buffer of nbytes, page-locked when pin.

    Pinned by cudaHostRegister on an ordinary allocation rather than by torch's pinned
    allocator, which rounds each block up to a power of two: an 84 MB adapter would hold 128 MB.
    The registration ends when the buffer (a base every view keeps alive) is freed.
    """
    buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
    if pin:
        from torch.cuda import _pin_memory_utils

        _pin_memory_utils.pin_memory(buf.data_ptr(), buf.numel())
        weakref.finalize(buf, _pin_memory_utils.unpin_memory, buf.data_ptr())
    return buf


def carve(buf: torch.Tensor, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Views of buf, one per shape, at ALIGN-aligned offsets in order."""
    out, at = [], 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= d
        nbytes = n * dtype.itemsize
        out.append(buf[at : at + nbytes].view(dtype).view(shape))
        at += aligned(nbytes)
    return out


def buffer_bytes(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> int:
    total = 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= d
        total += aligned(n * dtype.itemsize)
    return total
