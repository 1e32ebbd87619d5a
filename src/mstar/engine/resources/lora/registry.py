"""The adapters a deployment serves: each name's current version, checked when it was registered."""

from __future__ import annotations

import bisect
import itertools
import os
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class Sizes(dict):
    """A version's host bytes per node, shared by every version of the same sizes (adapters of one rank and
    targets take the same bytes): 100,000 names hold a handful of these, not one each. Read-only by use."""

    __slots__ = ("__weakref__",)


_sizes: weakref.WeakValueDictionary[tuple, Sizes] = weakref.WeakValueDictionary()
_sizes_lock = threading.Lock()


def shared_sizes(sizes: Mapping[str, int]) -> Sizes:
    """The one Sizes of these sizes."""
    key = tuple(sorted(sizes.items()))
    with _sizes_lock:
        got = _sizes.get(key)
        if got is None:
            got = _sizes[key] = Sizes(sizes)
        return got


@dataclass(frozen=True, slots=True)
class Version:
    """One adapter's weights: its name, where they were checked (a path, pinned to a commit for a Hub
    id; or the tensors pushed, with their config), and their digest, which roots its requests'
    prefix-cache keys. A reload is a new version of the same name. key is the name the host and device
    tiers hold this version under, apart from its other versions. Slotted, a path kept as its str and
    the host bytes shared with every version of the same (Sizes): a deployment registers 100,000 of them,
    and a step looks at hundreds."""

    name: str
    path: str | os.PathLike[str] | None
    digest: bytes
    tensors: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)
    config: Any = field(default=None, compare=False, repr=False)
    nbytes: Mapping[str, int] = field(default_factory=dict, compare=False, repr=False)  # host bytes per node
    key: str = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", f"{self.name}@{self.digest.hex()[:16]}")
        if isinstance(self.path, os.PathLike):  # a Path keeps its parts beside its str: three times the bytes
            object.__setattr__(self, "path", os.fspath(self.path))
        if not isinstance(self.nbytes, Sizes):
            object.__setattr__(self, "nbytes", shared_sizes(self.nbytes))

    def __hash__(self) -> int:  # a step hashes thousands: the key is hashed once, as a str caches it
        return hash(self.key)


class Registry:
    """Each registered name's current version, and the names whose version failed to read.

    Registering a name again makes a new version current (a reload); requests pinned to the old one
    keep it. A failed name refuses new requests until it is registered again.
    """

    def __init__(self) -> None:
        self._current: dict[str, Version] = {}
        self._failed: dict[str, ValueError] = {}
        self._peak = 0  # the most names registered since the dicts were last made anew
        self._lock = threading.Lock()  # the names' order for listing, beside changes of the names
        self._sorted: list[str] | None = None  # the names in order, for listing; made anew after a change of names
        self._changes = 0  # changes of the names so far: a listing sorted before the last one is not kept

    def register(self, version: Version) -> None:
        """Make version its name's current one (a reload where the name had another). The name has a
        version at every moment of it: a step resolving it from another thread meanwhile never finds it
        unregistered."""
        old = self._current.get(version.name)
        if old is None:
            with self._lock:
                self._current[version.name] = version
                self._sorted, self._changes = None, self._changes + 1
        else:
            self._current[version.name] = version
        self._peak = max(self._peak, len(self._current))
        self._failed.pop(version.name, None)

    def unregister(self, name: str) -> None:
        with self._lock:
            if self._current.pop(name, None) is not None:
                self._sorted, self._changes = None, self._changes + 1
        self._failed.pop(name, None)
        if len(self._current) * 4 < self._peak:  # a dict never shrinks as it empties: made anew, it gives its
            with self._lock:  # table back
                self._current, self._failed, self._peak = dict(self._current), dict(self._failed), len(self._current)

    def is_current(self, key: str) -> bool:
        """Whether key is some name's current version (a key is name@ and 16 hex digits)."""
        v = self._current.get(key[:-17])
        return v is not None and v.key == key

    def resolve(self, name: str) -> Version | ValueError:
        """The version a new request for name gets, or why it cannot have one."""
        v = self._current.get(name)
        if v is None:
            return ValueError(f"adapter {name!r} is not registered")
        return self._failed.get(name, v) if self._failed else v

    def fail(self, version: Version, error: ValueError) -> None:
        """version could not be read: new requests for its name are refused with error, if it is current."""
        if self._current.get(version.name) == version:
            self._failed[version.name] = error

    def page(self, after: str | None, limit: int) -> list[tuple[Version, ValueError | None]]:
        """Up to limit names after after (None: from the first), in order, each with its current version and
        why it failed, if it did. Sorting is paid once after the names change, not per page, and outside the
        lock a registration takes; a sort that a change overtook serves its page but is not kept."""
        with self._lock:
            names, changes = self._sorted, self._changes
            fresh = names is None
            if fresh:
                names = list(self._current)
        if fresh:
            names.sort()
            with self._lock:
                if self._changes == changes:
                    self._sorted = names
        at = 0 if after is None else bisect.bisect_right(names, after)
        out = []
        for name in itertools.islice(names, at, None):  # past the names unregistered since the list was made
            v = self._current.get(name)
            if v is not None:
                out.append((v, self._failed.get(name)))
                if len(out) == limit:
                    break
        return out

    def __contains__(self, name: object) -> bool:
        return name in self._current

    def __len__(self) -> int:
        return len(self._current)
