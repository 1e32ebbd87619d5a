"""Resolvers: where a manager looks for an adapter a request names before any registration did.

A resolver is any callable name -> source (a path, a Hub id, an object-store URL), or None where it has no
such adapter; `where` (an attribute, if it has one) says where it looked, for the refusal of a name no
source has. It runs on the manager's resolving workers, never on a step, and the source it gives is checked
as a registration is. The built-ins take only names that cannot step outside their root: no '/', no '..',
no leading '.', printable ASCII, at most 200 characters.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from . import objects, urls

NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,199}")


def plain(name: str) -> bool:
    """Whether name can name a folder or object under a root and nothing outside it."""
    return isinstance(name, str) and NAME.fullmatch(name) is not None and ".." not in name


class FolderResolver:
    """root/name, a folder of PEFT adapter folders (a shared volume a trainer writes to, say)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.where = f"folder {self.root}"

    def __call__(self, name: str) -> Path | None:
        path = self.root / name
        return path if plain(name) and (path / "adapter_config.json").is_file() else None


class HubResolver:
    """org/name on the Hugging Face Hub (name alone if it holds the org: 'org/repo'); checked and pinned to
    its commit as a registration is, through huggingface_hub's cache and token."""

    def __init__(self, org: str | None = None) -> None:
        self.org = org
        self.where = f"the Hub under {org}/" if org else "the Hub"

    def __call__(self, name: str) -> str | None:
        if self.org is None:
            org, _, repo = name.partition("/")
            return name if plain(org) and plain(repo) else None
        return f"{self.org}/{name}" if plain(name) else None


class ObjectStoreResolver:
    """prefix/name/ in object storage (s3://bucket/adapters/, gs://, az://): the adapter there if its
    adapter_config.json is (one HEAD), read through the manager's disk tier."""

    def __init__(self, prefix: str) -> None:
        if not isinstance(prefix, str):
            raise ValueError(f"an object-store prefix is a URL ({', '.join(objects.SCHEMES)}), not a "
                             f"{type(prefix).__name__}")
        try:
            self.prefix = urls.checked(prefix)
        except ValueError as e:
            raise ValueError(f"object-store prefix {urls.redacted(prefix)}: {e}") from None
        self.where = f"object store {self.prefix}"

    def __call__(self, name: str) -> str | None:
        if not plain(name):
            return None
        url = f"{self.prefix}{name}/"
        return url if objects.has_adapter(url) else None


def where(resolver: object) -> str:
    return getattr(resolver, "where", None) or f"resolver {getattr(resolver, '__name__', type(resolver).__name__)}"
