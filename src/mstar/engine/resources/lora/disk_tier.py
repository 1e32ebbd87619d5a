"""The local disk tier: remote adapters' files kept on local disk within a byte budget, least recent dropped.

Each pinned adapter (objects.Remote: its URL and its objects' ETags and sizes) has a folder named by a hash
of its pin, so a replaced object is another folder, never the old one's bytes. A file is downloaded to a
temporary name and renamed when whole, and the folder is renamed into place once every file is: a partial
download is never read. Concurrent fetches of one pin share one download. A folder in use (being checked
or read) is never dropped; past the budget the least recently used others go, folder by folder.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

from . import objects
from .objects import Remote


class DiskTier:
    """Remote adapters' files under root, at most max_bytes of them beside those in use."""

    def __init__(self, root: str | os.PathLike[str], max_bytes: int) -> None:
        self.root, self.max_bytes = Path(root), max_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._lru: OrderedDict[str, int] = OrderedDict()  # folder -> bytes, least recent first
        self._fetching: dict[str, Future[Path]] = {}
        self._using: dict[str, int] = {}
        self.downloads = 0  # files downloaded, for tests and metrics
        for old in self.root.iterdir():  # a restart: partial folders go, whole ones are kept, oldest first
            if old.name.startswith("."):
                shutil.rmtree(old, ignore_errors=True)
        for folder in sorted((p for p in self.root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime):
            self._lru[folder.name] = sum(f.stat().st_size for f in folder.iterdir())

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(self._lru.values())

    def __contains__(self, remote: object) -> bool:
        return isinstance(remote, Remote) and _folder(remote) in self._lru

    @contextmanager
    def local(self, remote: Remote) -> Iterator[Path]:
        """remote's folder on local disk, downloaded first if it is not here, kept from eviction while in use.
        A ValueError (saying why, naming the file) if it cannot be fetched whole as pinned."""
        key = _folder(remote)
        with self._lock:
            self._using[key] = self._using.get(key, 0) + 1
        try:
            yield self._fetch(remote, key)
        finally:
            with self._lock:
                self._using[key] -= 1
                if not self._using[key]:
                    del self._using[key]
            self._trim()

    def _fetch(self, remote: Remote, key: str) -> Path:
        folder = self.root / key
        with self._lock:
            if key in self._lru and folder.is_dir():
                self._lru.move_to_end(key)
                return folder
            self._lru.pop(key, None)
            future = self._fetching.get(key)
            mine = future is None
            if mine:
                future = self._fetching[key] = Future()
        if not mine:
            return future.result()
        try:
            tmp = self.root / f".{key}.{os.getpid()}.{threading.get_ident()}"
            tmp.mkdir()
            try:
                for name, etag, size in remote.objects:
                    objects.download(remote, name, etag, size, tmp / name)
                    self.downloads += 1
                try:
                    os.replace(tmp, folder)
                except OSError:  # another process sharing the root renamed the same pin's folder first
                    if not folder.is_dir():
                        raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException as e:
            with self._lock:
                del self._fetching[key]
            future.set_exception(e)
            raise
        with self._lock:
            self._lru[key] = remote.nbytes
            del self._fetching[key]
        future.set_result(folder)
        return folder

    def evict(self, remote: Remote) -> bool:
        """remote's folder dropped now, unless in use: whether it was."""
        key = _folder(remote)
        with self._lock:
            if key in self._using or key not in self._lru:
                return False
            del self._lru[key]
        shutil.rmtree(self.root / key, ignore_errors=True)
        return True

    def _trim(self) -> None:
        with self._lock:
            over = sum(self._lru.values()) - self.max_bytes
            gone = []
            for key, n in list(self._lru.items()):
                if over <= 0:
                    break
                if key not in self._using:
                    del self._lru[key]
                    gone.append(key)
                    over -= n
        for key in gone:
            shutil.rmtree(self.root / key, ignore_errors=True)


def _folder(remote: Remote) -> str:
    return hashlib.blake2b(repr((remote.url, remote.objects)).encode(), digest_size=16).hexdigest()


def default_tier() -> DiskTier:
    """The tier a manager makes when a remote adapter first comes: $MSTAR_LORA_DISK_TIER (default
    ~/.cache/mstar-lora/objects), $MSTAR_LORA_DISK_BYTES (default 20 GB)."""
    root = os.environ.get("MSTAR_LORA_DISK_TIER", str(Path.home() / ".cache" / "mstar-lora" / "objects"))
    return DiskTier(root, int(os.environ.get("MSTAR_LORA_DISK_BYTES", 20 * 10**9)))
