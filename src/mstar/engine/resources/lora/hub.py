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
    that exists is always a path, and so is one whose first folder exists here (adapters/sql-expert
    mistyped is a missing file, not a Hub repo)."""
    text = os.fspath(source)
    m = HUB_ID.fullmatch(text)
    if m is None or text.startswith((".", "/")) or Path(text).exists() or Path(m["repo"].split("/")[0]).is_dir():
        return None
    return m["repo"], m["revision"]


def resolve(source: str | os.PathLike[str]) -> Path:
    """source as a local path: itself, or a Hub id's snapshot folder at one commit. A ValueError says
    why not without repeating source, which its caller names."""
    found = hub_id(source)
    if found is None:
        return Path(source)
    repo, revision = found
    # source is no local path, so each message says so before what the Hub answered
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        raise ValueError("no such file or directory; read as a Hub id, it needs huggingface_hub "
                         "(pip install huggingface_hub)") from None
    why = _unsafe(repo, revision)
    if why:
        raise ValueError(f"no such file or directory; read as a Hub id, {why}")
    it = f"its revision {revision!r}" if revision else "it"
    try:
        found = Path(snapshot_download(repo, revision=revision, allow_patterns=ADAPTER_FILES))
    except RevisionNotFoundError:
        raise ValueError(f"no such file or directory, and Hub repo {repo!r} has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        raise ValueError("no such file or directory, nor a Hub repo (one you may read)") from None
    except LocalEntryNotFoundError:
        raise ValueError(f"no such file or directory; read as a Hub id, {it} is not in the local Hub cache, and the "
                         "Hub cannot be reached (offline, or no network)") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"no such file or directory; read as a Hub id, {it} could not be fetched ({e})") from None
    return _in_cache(found, repo)


def _unsafe(repo: str, revision: str | None) -> str | None:
    """Why a Hub id could name something outside its repo's cache folder, or None. Git's ref names hold
    no '..', no empty or hidden components, and no leading or trailing slash; the Hub's repo ids no '..'."""
    if ".." in repo:
        return f"the repo id {repo!r} holds '..'"
    if revision is not None:
        parts = revision.split("/")
        if ".." in revision or revision.startswith("/") or any(not p or p.startswith(".") for p in parts):
            return f"the revision {revision!r} is not a git ref name (empty or hidden components, '..', a slash)"
    return None


def _in_cache(found: Path, repo: str) -> Path:
    """found, checked to be the repo's snapshot of one commit inside the Hub cache: offline, huggingface_hub
    takes a ref file's text as the commit, and a ref may name anything."""
    from huggingface_hub import constants

    org, name = repo.split("/")
    snapshots = Path(constants.HF_HUB_CACHE).resolve() / f"models--{org}--{name}" / "snapshots"
    real = found.resolve()
    if real.parent != snapshots or not re.fullmatch(r"[0-9a-f]{40}", real.name):
        raise ValueError(f"no such file or directory; read as a Hub id, it resolved to {found}, which is not one "
                         f"commit's snapshot in the Hub cache ({snapshots})")
    return found
