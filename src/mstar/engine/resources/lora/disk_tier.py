"""The local disk tier: remote adapters' files kept on local disk within a byte budget, least recent dropped.

Everything it keeps lies in root/mstar-lora-tier, a folder of its own, and there it touches only what it
names: a folder per pinned adapter (32 hex digits, a hash of its pin: a replaced object is another
folder), its lock file (<hex>.lock), and its temporary names (.<hex>.part while it downloads,
.<hex>.<hex>.gone while it is deleted). Anything else, in root or in its folder, is left alone, so root
may be a directory others share. An earlier version kept its folders in root itself (root/<hex>, and
.<hex>.<pid>.<tid> while it downloaded), and took root for its own: where root holds nothing but those
(and the tier's folder), a start takes each such folder that holds exactly an adapter's two files into its
own folder, to be used and dropped within max_bytes as any other, and removes such half downloads; a root
holding anything else is shared, and is left as it is.

Several processes may share one root (every rank of a node, servers on a shared volume), kept apart by
flock on a folder's lock file: a download holds it exclusive (one download of a pin at a time, and a
starting process removes a .part only where it can take the lock), a user of the folder holds it shared
while it reads, and an eviction removes a folder only where it takes it exclusive without waiting. A wait
for another process's download has a deadline: `wait` seconds in which its .part does not grow (a
download stalled, a process stopped) fail the adapter, naming the lock file the other process holds. Files
are downloaded to temporary names and renamed when whole, the folder renamed into place once every file
is and renamed out of place before it is deleted: a partial folder is never read. Recency is a folder's
mtime, touched at each use, so every process sharing root sees one LRU order. Room is made before a
download, not after it: the least recent folders go to leave max_bytes with it, and on a disk full even so
(a budget larger than the disk) every folder not in use goes before the download is refused.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager, suppress
from pathlib import Path

from . import objects
from .objects import Remote

HOME = "mstar-lora-tier"
KEY = re.compile(r"[0-9a-f]{32}")
PART = re.compile(r"\.([0-9a-f]{32})\.part")
GONE = re.compile(r"\.[0-9a-f]{32}\.[0-9a-f]{32}\.gone")
EARLIER = re.compile(r"\.([0-9a-f]{32})\.[0-9]+\.[0-9]+")  # an earlier version's download, in root itself
EARLIER_PART = re.compile(r"\.(?:adapter_config\.json|adapter_model\.safetensors)\.[0-9]+\.part")
ATTEMPTS = 3  # fetches of a folder that other processes evict as soon as it lands, before giving up
POLL = 0.05  # seconds between looks at a download another process holds
WAIT = 120.0  # seconds another process's download may go without progress (the resolver_timeout's default)


class DiskTier:
    """Remote adapters' files under root/mstar-lora-tier, at most max_bytes of them beside those in use; at most
    wait seconds waited for another process's download of one that makes no progress."""

    def __init__(self, root: str | os.PathLike[str], max_bytes: int, wait: float = WAIT) -> None:
        self.root, self.max_bytes, self.wait = Path(root), max_bytes, wait
        self.home = self.root / HOME
        self.home.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._fetching: dict[str, Future[None]] = {}
        self._sizes: dict[str, int] = {}  # a folder's bytes: it never changes once in place
        self.downloads = 0  # files downloaded, for tests and metrics
        self._sweep()

    def _sweep(self) -> None:
        """What ended processes left: folders half deleted, and downloads whose lock no live process holds."""
        for entry in os.scandir(self.home):
            part = PART.fullmatch(entry.name)
            if GONE.fullmatch(entry.name):
                _remove(entry.path)
            elif part:
                with suppress(OSError):  # a lock it cannot take (a link at its name): its use is refused
                    fd = self._locked(part[1], fcntl.LOCK_EX | fcntl.LOCK_NB)
                    if fd is not None:
                        _remove(entry.path)
                        self._release(part[1], fd)
        with suppress(OSError):  # a root it may not read or change: what an earlier version left stays
            self._adopt()

    def _adopt(self) -> None:
        """What an earlier version kept in root itself, where root holds nothing else (that version took root
        for its own, so a root others share may hold an adapter of theirs in a 32-hex folder: left alone): its
        whole folders taken in (dropped where the same pin's folder is here already; another process's to
        take while it holds their lock), its half downloads removed."""
        entries, folders, halves = list(os.scandir(self.root)), [], []
        for entry in entries:
            names = _plain_files(entry)
            if entry.name == HOME:
                continue
            if names is not None and KEY.fullmatch(entry.name) and names == set(objects.FILES):
                folders.append(entry)
            elif names is not None and EARLIER.fullmatch(entry.name) and all(
                    n in objects.FILES or EARLIER_PART.fullmatch(n) for n in names):
                halves.append(entry)
            else:
                return  # another's thing: root is shared, and nothing of it is the tier's to touch
        for entry in halves:
            _remove(entry.path)
        for entry in folders:
            fd = self._locked(entry.name, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if fd is None:
                continue
            here = _is_folder(self.home / entry.name)  # the same pin's files: the earlier copy is dropped
            gone = self.home / (entry.name if not here else f".{entry.name}.{uuid.uuid4().hex}.gone")
            try:
                with suppress(OSError):  # another process's start took it first
                    os.rename(entry.path, gone)
                if here:
                    _remove(gone)
            finally:
                self._release(entry.name, fd)

    @property
    def nbytes(self) -> int:
        return sum(n for _, _, n in self._folders())

    def __contains__(self, remote: object) -> bool:
        return isinstance(remote, Remote) and _is_folder(self.home / _folder(remote))

    @contextmanager
    def local(self, remote: Remote) -> Iterator[Path]:
        """remote's folder on local disk, downloaded first if it is not here, kept from eviction (by any
        process) while in use. A ValueError (saying why, naming the file) if it cannot be fetched whole as
        pinned."""
        key = _folder(remote)
        try:
            fd = self._hold(remote, key)
        except OSError as e:  # the local disk's, before any file: said without the tier's temporary paths
            raise ValueError(f"{' and '.join(objects.FILES)} could not be written to the disk tier "
                             f"({e.strerror or type(e).__name__})") from None
        try:
            yield self.home / key
        finally:
            os.close(fd)
            with suppress(OSError):  # a folder it may not drop (another user's, a read-only tier) stays
                self._trim()

    def _hold(self, remote: Remote, key: str) -> int:
        """key's lock held shared, once its folder is in place: fetched first if it is not, and again if
        another process evicted it between the fetch and the lock."""
        folder = self.home / key
        for _ in range(ATTEMPTS):
            with self._lock:
                future = self._fetching.get(key)
            if future is not None:  # this process's download of it: its outcome is this call's too
                future.result()
            fd = self._waited(key, fcntl.LOCK_SH)
            if fd is not None and not _is_folder(folder):
                os.close(fd)
                fd = self._fetch(remote, key)
            if fd is not None and _is_folder(folder):
                with suppress(OSError):  # another user's folder on a shared volume: its order is theirs
                    os.utime(folder)
                return fd
            if fd is not None:
                os.close(fd)
        raise ValueError(f"other processes sharing the disk tier at {self.root} evicted it {ATTEMPTS} times as "
                         "soon as it was fetched: their max_bytes leaves no room for it")

    def _fetch(self, remote: Remote, key: str) -> int | None:
        """key's folder put in place, by one download for all this process's threads, unless another
        process puts it there first; the lock held shared where this thread took it to download (None
        elsewhere): downgraded, not let go, so that no eviction comes between the download and its use."""
        with self._lock:
            future = self._fetching.get(key)
            mine = future is None
            if mine:
                future = self._fetching[key] = Future()
        if not mine:
            future.result()
            return None
        try:
            fd = self._exclusive(key)
            if fd is not None:
                try:
                    if not _is_folder(self.home / key):
                        self._make_room(remote, key)
                    fcntl.flock(fd, fcntl.LOCK_SH)  # Linux converts it at once; elsewhere _hold looks again
                except BaseException:
                    self._release(key, fd)
                    raise
        except BaseException as e:
            with self._lock:
                del self._fetching[key]
            future.set_exception(e)
            raise
        with self._lock:
            del self._fetching[key]
        future.set_result(None)
        return fd

    def _exclusive(self, key: str) -> int | None:
        """key's lock held exclusive to download it, or None once its folder is in place. Polled, not waited
        for: readers of a folder in place hold the lock shared as long as they read."""
        return self._waited(key, fcntl.LOCK_EX)

    def _waited(self, key: str, how: int) -> int | None:
        """key's lock held `how` (LOCK_SH to read, LOCK_EX to download), polled while another process holds
        it: None where an exclusive one is wanted and the folder stands in place (its readers hold it). A
        ValueError naming the lock file once it has been held `wait` seconds while no .part of key grew."""
        progress, deadline = None, time.monotonic() + self.wait
        while True:
            fd = self._locked(key, how | fcntl.LOCK_NB)
            if fd is not None:
                return fd
            if how == fcntl.LOCK_EX and _is_folder(self.home / key):
                return None
            now, seen = time.monotonic(), _progress(self.home / f".{key}.part")
            if seen != progress:  # the holder's download goes on: its deadline with it
                progress, deadline = seen, now + self.wait
            elif now >= deadline:
                raise ValueError(f"another process has held {self.home / f'{key}.lock'} for {self.wait:g} s while "
                                 "its download made no progress (a download stalled, or a process stopped): "
                                 "that process holds the adapter's files")
            time.sleep(POLL)

    def _make_room(self, remote: Remote, key: str) -> None:
        """remote downloaded into key (its lock held exclusive), room made for it first: the least recent
        folders dropped to leave max_bytes with it, and every folder not in use if the disk is full even so."""
        with suppress(OSError):
            self._trim(self.max_bytes - remote.nbytes)
        try:
            self._download(remote, key)
        except objects.LocalDisk as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT) or not self._trim(0):
                raise
            self._download(remote, key)

    def _download(self, remote: Remote, key: str) -> None:
        """remote's files into .<key>.part, renamed to key once whole (key's lock held exclusive)."""
        part = self.home / f".{key}.part"
        _remove(part)  # an ended process's: a live one would hold the lock
        part.mkdir()
        try:
            for name, etag, size in remote.objects:
                objects.download(remote, name, etag, size, part / name)
                self.downloads += 1
            _remove(self.home / key)  # no folder (_hold looked, under the lock), but maybe a link or a file
            os.rename(part, self.home / key)
            self._sizes[key] = remote.nbytes
        finally:
            _remove(part)

    def evict(self, remote: Remote) -> bool:
        """remote's folder dropped now, unless in use, here or by another process: whether it was."""
        return self._drop(_folder(remote))

    def _trim(self, keep: int | None = None) -> bool:
        """Folders dropped, least recently used first, until the rest fit keep bytes (max_bytes unless said);
        one in use is skipped. Whether any was."""
        folders, dropped = self._folders(), False
        over = sum(n for _, _, n in folders) - (self.max_bytes if keep is None else keep)
        for _, key, n in sorted(folders):
            if over <= 0:
                break
            if self._drop(key):
                over, dropped = over - n, True
        return dropped

    def _drop(self, key: str) -> bool:
        fd = self._locked(key, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if fd is None:
            return False
        gone = self.home / f".{key}.{uuid.uuid4().hex}.gone"
        try:
            if not _is_folder(self.home / key):
                return False
            os.rename(self.home / key, gone)  # whole at its name or not there: never half deleted
        except OSError:  # one it may not rename (another user's, under a sticky folder) stays
            return False
        finally:
            self._release(key, fd)
        self._sizes.pop(key, None)
        _remove(gone)
        return True

    def _folders(self) -> list[tuple[int, str, int]]:
        """(mtime, key, bytes) of each folder in place, as every process sharing root sees them."""
        try:
            entries = list(os.scandir(self.home))
        except FileNotFoundError:  # removed under it: nothing of its own is there
            return []
        out = []
        for entry in entries:
            try:
                if KEY.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
                    n = self._sizes.get(entry.name)  # read once: another thread's eviction may pop it
                    if n is None:
                        n = self._sizes[entry.name] = sum(f.stat().st_size for f in os.scandir(entry.path))
                    out.append((entry.stat(follow_symlinks=False).st_mtime_ns, entry.name, n))
            except FileNotFoundError:  # evicted meanwhile by another process
                continue
        present = {key for _, key, _ in out}
        for key in list(self._sizes):  # those gone, by whichever process
            if key not in present:
                self._sizes.pop(key, None)
        return out

    def _locked(self, key: str, how: int) -> int | None:
        """key's lock file, open and flocked `how` (LOCK_SH or LOCK_EX, | LOCK_NB not to wait: None if another
        holds it). An eviction unlinks the file: a lock taken on one no longer at its path is taken again."""
        path = self.home / f"{key}.lock"
        flags = os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW  # a link there makes no file where it points
        while True:
            try:
                fd = os.open(path, flags, 0o666)
            except FileNotFoundError:  # its folder removed under it (a cache cleaned): made again
                self.home.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, flags, 0o666)
            try:
                fcntl.flock(fd, how)
            except BlockingIOError:
                os.close(fd)
                return None
            except BaseException:
                os.close(fd)
                raise
            try:
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)

    def _release(self, key: str, fd: int) -> None:
        """An exclusive lock let go; its file unlinked first where no folder stands for it to guard."""
        try:
            if not _is_folder(self.home / key):
                with suppress(FileNotFoundError):
                    os.unlink(self.home / f"{key}.lock")
        finally:
            os.close(fd)


def _is_folder(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _plain_files(entry: os.DirEntry[str]) -> set[str] | None:
    """The names in a folder (not a link to one) that holds regular files alone, or None."""
    try:
        if not entry.is_dir(follow_symlinks=False):
            return None
        inside = list(os.scandir(entry.path))
        return {e.name for e in inside} if all(e.is_file(follow_symlinks=False) for e in inside) else None
    except OSError:
        return None


def _progress(part: Path) -> tuple[int, ...]:
    """The sizes of what a download has written so far under part (none if there is no part)."""
    try:
        return tuple(sorted(e.stat(follow_symlinks=False).st_size for e in os.scandir(part)))
    except OSError:
        return ()


def _remove(path: str | os.PathLike[str]) -> None:
    """Whatever stands at path gone: a folder with what it holds, a link (never where it points) or a file."""
    if _is_folder(Path(path)):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with suppress(FileNotFoundError):
            os.unlink(path)


def _folder(remote: Remote) -> str:
    return hashlib.blake2b(repr((remote.url, remote.objects)).encode(), digest_size=16).hexdigest()


def default_tier() -> DiskTier:
    """The tier a manager makes when a remote adapter first comes: $MSTAR_LORA_DISK_TIER (default
    ~/.cache/mstar-lora/objects), $MSTAR_LORA_DISK_BYTES (default 20 GB)."""
    root = os.environ.get("MSTAR_LORA_DISK_TIER", str(Path.home() / ".cache" / "mstar-lora" / "objects"))
    return DiskTier(root, int(os.environ.get("MSTAR_LORA_DISK_BYTES", 20 * 10**9)))
