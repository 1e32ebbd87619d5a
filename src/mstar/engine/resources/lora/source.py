"""Where a read's bytes come from: a file opened once, pushed tensors, or a snapshot in memory.

Each is read the same way, read_into(views, at) filling memory from a byte offset, so the reader
follows one plan over any of them. A file is opened once per read: its header, its hash and its copy
see one inode, and a new version renamed over the path meanwhile is not this read's business. Nothing
is mapped, so a file truncated under a read ends it with a short read, which is refused, never with a
SIGBUS. Pushed tensors are read at the offsets their header gives them, a copy of their memory as it
is when each piece is read.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import stat
import weakref
from collections.abc import Sequence
from pathlib import Path

import torch


class FileSource:
    """One open regular file and its size when it was opened. Closed by close(), or when collected."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        # O_NONBLOCK: a FIFO swapped in for the file must not block the open; it is refused just below.
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        self._close = weakref.finalize(self, os.close, fd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            self.close()
            raise OSError(f"{self.path.name} is not a regular file")
        self.fd, self.size = fd, st.st_size

    def close(self) -> None:
        self._close()

    @property
    def closed(self) -> bool:
        return not self._close.alive

    def read(self, nbytes: int, at: int) -> bytes:
        """nbytes from offset at, fewer only where the file ends first."""
        out = bytearray()
        while len(out) < nbytes:
            got = os.pread(self.fd, nbytes - len(out), at + len(out))
            if not got:
                break
            out += got
        return bytes(out)

    def read_into(self, views: list[memoryview], at: int) -> None:
        """Fill views, one after another, from offset at; ValueError if the file ends first (it was cut
        since it was opened)."""
        views = [v for v in views if len(v)]
        while views:
            got = os.preadv(self.fd, views, at)
            if got == 0:
                raise ValueError("the file ended early: it was cut or rewritten since its header was read")
            at += got
            while views and got >= len(views[0]):  # a short read (a signal, a huge run): on from where it stopped
                got -= len(views.pop(0))
            if got:
                views[0] = views[0][got:]

    def unchanged(self) -> bool:
        """Whether the file still has the size it was opened with (a rewrite in place may keep it)."""
        return os.fstat(self.fd).st_size == self.size


class MemorySource:
    """Bytes already in memory (a snapshot of a file, whose offsets are the file's), read by copying."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data, self.size = data, data.numel()

    def read_into(self, views: list[memoryview], at: int) -> None:
        base = self.data.data_ptr()
        for v in views:
            if at + len(v) > self.size:
                raise ValueError("the snapshot ended early")
            _copy(v, base + at)
            at += len(v)

    def unchanged(self) -> bool:
        return True


class TensorSource:
    """Pushed tensors at the offsets their header lists them at (starts, in that order), read as a file
    holding them would be. Gaps between them read as zeros. The tensors are read, never written; one
    that is not a contiguous CPU tensor is copied into one first."""

    def __init__(self, tensors: Sequence[torch.Tensor], starts: Sequence[int], size: int) -> None:
        self._tensors = [t if t.device.type == "cpu" and t.is_contiguous() else t.contiguous().cpu() for t in tensors]
        self._starts = list(starts)
        self._spans = [(s, s + t.numel() * t.element_size(), t.data_ptr()) for s, t in
                       zip(self._starts, self._tensors, strict=True)]
        self.size = size

    def read_into(self, views: list[memoryview], at: int) -> None:
        for v in views:
            self._fill(v, at)
            at += len(v)

    def _fill(self, view: memoryview, at: int) -> None:
        stop = at + len(view)
        if stop > self.size:
            raise ValueError("the tensors end before the bytes asked for")
        i = max(bisect.bisect_right(self._starts, at) - 1, 0)
        done = 0
        while done < len(view):
            pos = at + done
            start, end, address = self._spans[i] if i < len(self._spans) else (self.size, self.size, 0)
            if pos < start:  # a gap before the next tensor
                n = min(start, stop) - pos
                view[done : done + n] = bytes(n)
            elif pos < end:
                n = min(end, stop) - pos
                _copy(view[done : done + n], address + pos - start)
            else:
                i += 1
                continue
            done += n

    def unchanged(self) -> bool:
        return True


def _copy(view: memoryview, address: int) -> None:
    """view filled with its length of bytes from address (memmove releases the GIL)."""
    n = len(view)
    if n:
        ctypes.memmove((ctypes.c_char * n).from_buffer(view), address, n)
