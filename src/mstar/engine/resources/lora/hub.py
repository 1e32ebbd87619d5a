"""Adapters named by Hugging Face Hub id: `org/repo`, optionally `@revision`.

They are resolved with huggingface_hub, through its own cache, token and offline settings, fetching
only the adapter's config and safetensors files. The folder it answers with is named after the
commit, so a path resolved once is pinned: every later read, on every rank, reads the same bytes.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# A Hub repo id (org/name, letters, digits, - _ .) and an optional @revision (branch, tag or commit).
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?")
ADAPTER_FILES = ["adapter_config.json", "*.safetensors"]


def hub_id(source: str | os.PathLike[str]) -> tuple[str, str | None] | None:
    """(repo, revision) when source names a Hub repo rather than a local path, else None. A path
    that exists is always a path."""
    text = os.fspath(source)
    m = HUB_ID.fullmatch(text)
    if m is None or Path(text).exists() or text.startswith((".", "/")):
        return None
    return m["repo"], m["revision"]


def resolve(source: str | os.PathLike[str]) -> Path:
    """source as a local path: itself, or a Hub id's snapshot folder at one commit."""
    found = hub_id(source)
    if found is None:
        return Path(source)
    repo, revision = found
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        raise ValueError(f"{source}: a Hub id, and naming adapters by Hub id needs huggingface_hub "
                         "(pip install huggingface_hub)") from None
    at = f"revision {revision!r} of " if revision else ""
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=ADAPTER_FILES))
    except RevisionNotFoundError:
        raise ValueError(f"{source}: the Hub repo {repo!r} has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        raise ValueError(f"{source}: no Hub repo {repo!r} (or no access to it)") from None
    except LocalEntryNotFoundError:
        raise ValueError(f"{source}: {at}Hub repo {repo!r} is not in the local cache, and the Hub cannot be "
                         "reached (offline, or no network)") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{source}: {at}Hub repo {repo!r} could not be fetched ({e})") from None
