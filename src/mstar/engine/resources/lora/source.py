"""Where a read's bytes come from: a file opened once, or pushed tensors.

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
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class Source(Protocol):
    """What a read reads from: read_into fills views, one after another, from a byte offset (nbytes, where
    given, is their total, which the caller knows)."""

    size: int

    def read_into(self, views: list[memoryview], at: int, nbytes: int | None = None) -> None: ...

    def unchanged(self) -> bool: ...


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
        self.fd, self.size, self.mtime_ns = fd, st.st_size, st.st_mtime_ns

    def close(self) -> None:
        self._close()

    @property
    def closed(self) -> bool:
        return not self._close.alive

    def read(self, nbytes: int, at: int) -> bytes:
        """nbytes from offset at, fewer only where the file ends first."""
        try:
            first = os.pread(self.fd, nbytes, at)
            if len(first) == nbytes or not first:  # the whole of it at once, as a regular file gives it
                return first
            out = bytearray(first)
            while len(out) < nbytes:
                got = os.pread(self.fd, nbytes - len(out), at + len(out))
                if not got:
                    break
                out += got
        except OSError as e:
            raise ValueError(unreadable(e, at)) from None
        return bytes(out)

    def read_into(self, views: list[memoryview], at: int, nbytes: int | None = None) -> None:
        """Fill views, one after another, from offset at; ValueError if the file ends first (it was cut
        since it was opened). nbytes, their total where the caller knows it, lets a whole read (as a
        regular file gives one) return on one comparison: rank 3 of 8 reads in over a thousand calls."""
        got = self._preadv(views, at)
        if got != (sum(map(len, views)) if nbytes is None else nbytes):
            self._read_rest(views, at, got)

    def _read_rest(self, views: list[memoryview], at: int, got: int) -> None:
        """After a short read of got bytes (a signal, a huge run, the file's end): on from where it stopped."""
        views = [v for v in views if len(v)]
        while True:
            at += got
            while views and got >= len(views[0]):
                got -= len(views.pop(0))
            if not views:
                return
            if got:
                views[0] = views[0][got:]
            got = self._preadv(views, at)
            if got == 0:
                raise ValueError("the file ended early: it was cut or rewritten since its header was read")

    def _preadv(self, views: list[memoryview], at: int) -> int:
        try:
            return os.preadv(self.fd, views, at)
        except OSError as e:  # a disk's EIO, say: the read's refusal, naming its adapter and file
            raise ValueError(unreadable(e, at)) from None

    def unchanged(self) -> bool:
        """Whether the file still has the size it was opened with (a rewrite in place may keep it)."""
        return os.fstat(self.fd).st_size == self.size

    def changes(self) -> str | None:
        """Why the file is not as it was opened, or None: its size changed, or it was written (its
        modification time moved; a new version renamed over the path leaves this one's alone)."""
        st = os.fstat(self.fd)
        if st.st_size != self.size:
            return "the file changed size since its header was read"
        if st.st_mtime_ns != self.mtime_ns:
            return "the file was written while it was checked: check it again once it is written"
        return None


class TensorSource:
    """Pushed tensors at the offsets their header lists them at (starts, in that order), read as a file
    holding them would be. Gaps between them read as zeros. The tensors are read, never written; one
    that is not a contiguous CPU tensor is copied into one when first read. One read in place is looked
    at anew each time its bytes are read (a read copies them in chunks and runs): its storage may have
    been freed, moved or swapped meanwhile, and its old address would then be other memory."""

    def __init__(self, tensors: Sequence[torch.Tensor], starts: Sequence[int], size: int) -> None:
        self._tensors, self._starts, self.size = list(tensors), list(starts), size
        self._nbytes = [t.nbytes for t in self._tensors]  # as they were pushed
        self._copies: dict[int, memoryview] = {}  # copies made of tensors that were not contiguous CPU ones
        self._kept: list[torch.Tensor] = []

    def read_into(self, views: list[memoryview], at: int, nbytes: int | None = None) -> None:
        for v in views:
            self._fill(v, at)
            at += len(v)

    def _memory(self, i: int) -> memoryview:
        if i in self._copies:
            return self._copies[i]
        t = self._tensors[i]
        why = storage_shortfall(t)
        if why is None and t.nbytes != self._nbytes[i]:
            why = f"holds {t.nbytes} bytes, not the {self._nbytes[i]} it was pushed with"
        if why:
            raise ValueError(f"a pushed tensor {why}")
        if t.device.type != "cpu" or not t.is_contiguous():
            t = t.contiguous().cpu()
            self._kept.append(t)
            self._copies[i] = memory_at(t.data_ptr(), t.nbytes)
            return self._copies[i]
        return memory_at(t.data_ptr(), t.nbytes)

    def _fill(self, view: memoryview, at: int) -> None:
        stop = at + len(view)
        if stop > self.size:
            raise ValueError("the tensors end before the bytes asked for")
        i = max(bisect.bisect_right(self._starts, at) - 1, 0)
        done = 0
        while done < len(view):
            pos = at + done
            if i >= len(self._starts) or pos < self._starts[i]:  # a gap before the next tensor
                n = min(self._starts[i] if i < len(self._starts) else stop, stop) - pos
                view[done : done + n] = bytes(n)
                done += n
                continue
            memory = self._memory(i)
            start = self._starts[i]
            if pos >= start + len(memory):
                i += 1
                continue
            n = min(start + len(memory), stop) - pos
            view[done : done + n] = memory[pos - start : pos - start + n]
            done += n

    def unchanged(self) -> bool:
        return True


def unreadable(e: OSError, at: int) -> str:
    return f"unreadable at offset {at} ({e.strerror or e})"


def memory_at(address: int, n: int) -> memoryview:
    """n bytes of memory at address as a plain view, written only by whoever the caller lets (the memory's
    owner, which the caller holds, keeps it alive). Writable even where n is 0: os.preadv refuses a read-only
    buffer of any length, and a run may hold an empty part."""
    return memoryview((ctypes.c_char * n).from_address(address)).cast("B") if n else memoryview(bytearray())


def unreadable_memory(t: torch.Tensor) -> str | None:
    """Why t's values are not the bytes its storage holds at its offsets, or None: a tensor subclass that
    dispatches its own ops (a FakeTensor, a DTensor, whose storage is not its values), a nested tensor, or
    a storage freed or shrunk under it (storage_shortfall)."""
    import torch  # loaded already by whoever pushed a tensor

    if type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        return f"is a {type(t).__name__}, whose storage does not hold its values; push plain tensors"
    if t.is_nested:
        return "is a nested tensor; push one tensor per weight"
    return storage_shortfall(t)


def storage_shortfall(t: torch.Tensor) -> str | None:
    """Why t's storage does not hold every byte t reaches, or None: freed (FSDP frees a parameter's
    between uses) or shrunk since t was made, and read at its address, it would be read past its end."""
    if t.is_contiguous():
        need = t.storage_offset() * t.element_size() + t.nbytes
    elif t.numel() == 0:
        return None
    else:
        last = t.storage_offset() + sum((n - 1) * stride for n, stride in zip(t.shape, t.stride(), strict=True))
        need = (last + 1) * t.element_size()
    try:
        storage = t.untyped_storage()
        have, address = storage.nbytes(), storage.data_ptr()
    except (RuntimeError, NotImplementedError, TypeError) as e:
        return f"has no storage that can be read ({e})"
    if need > have or (address == 0 and need > 0):
        return (f"reaches byte {need} of its storage, which holds {have} (freed or resized since it was made?); "
                "push tensors whose storage holds them")
    return None
