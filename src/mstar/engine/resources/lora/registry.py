"""The adapters a deployment serves: each name's current version, checked when it was registered."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any


@dataclass(frozen=True)
class Version:
    """One adapter's weights: its name, where they were checked (a path, pinned to a commit for a Hub
    id; or the tensors pushed, with their config), and their digest, which roots its requests'
    prefix-cache keys. A reload is a new version of the same name."""

    name: str
    path: str | os.PathLike[str] | None
    digest: bytes
    tensors: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)
    config: Any = field(default=None, compare=False, repr=False)
    nbytes: Mapping[str, int] = field(default_factory=dict, compare=False, repr=False)  # host bytes per node

    @cached_property
    def key(self) -> str:
        """The name the host and device tiers hold this version under, apart from its other versions."""
        return f"{self.name}@{self.digest.hex()[:16]}"

    def __hash__(self) -> int:  # a step hashes thousands: the key is hashed once, as a str caches it
        return hash(self.key)


class Registry:
    """Each registered name's current version, and the names whose version failed to read.

    Registering a name again makes a new version current (a reload); requests pinned to the old one
    keep it. A failed name refuses new requests until it is registered again.
    """

    def __init__(self) -> None:
        self._current: dict[str, Version] = {}
        self._keys: set[str] = set()  # the current versions' keys
        self._failed: dict[str, ValueError] = {}

    def register(self, version: Version) -> None:
        """Make version its name's current one (a reload where the name had another). The name has a
        version at every moment of it: a step resolving it from another thread meanwhile never finds it
        unregistered."""
        old = self._current.get(version.name)
        self._current[version.name] = version
        self._keys.add(version.key)
        if old is not None and old.key != version.key:
            self._keys.discard(old.key)
        self._failed.pop(version.name, None)

    def unregister(self, name: str) -> None:
        old = self._current.pop(name, None)
        if old is not None:
            self._keys.discard(old.key)
        self._failed.pop(name, None)

    def is_current(self, key: str) -> bool:
        """Whether key is some name's current version."""
        return key in self._keys

    def resolve(self, name: str) -> Version | ValueError:
        """The version a new request for name gets, or why it cannot have one."""
        if name in self._failed:
            return self._failed[name]
        if name not in self._current:
            return ValueError(f"adapter {name!r} is not registered")
        return self._current[name]

    def fail(self, version: Version, error: ValueError) -> None:
        """version could not be read: new requests for its name are refused with error, if it is current."""
        if self._current.get(version.name) == version:
            self._failed[version.name] = error

    def __contains__(self, name: object) -> bool:
        return name in self._current

    def __len__(self) -> int:
        return len(self._current)
