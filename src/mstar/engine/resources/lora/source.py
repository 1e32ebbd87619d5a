"""An adapter's weights file, opened once per read: its header, its hash and its copy see one inode.

A new version renamed over the path while a read is under way is not this read's business: the
descriptor keeps the old file. Nothing is mapped, so a file truncated under a read ends it with a
short read, which is refused, never with a SIGBUS.
"""

from __future__ import annotations

import os
import stat
import weakref
from pathlib import Path


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
