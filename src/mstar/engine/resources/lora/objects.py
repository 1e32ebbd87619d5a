"""Adapters in object storage: `s3://bucket/prefix/`, and what obstore gives beside it (`gs://`, `az://`,
`https://`), each a folder of adapter_config.json and adapter_model.safetensors as PEFT saves one.

An adapter is pinned by one HEAD of each of the two files a folder is read from (checkpoint.locate_files),
never by a listing: an optimizer's or a checkpoint's files beside them are neither listed nor fetched, and
a plain HTTP server, which answers no listing, serves as well as a bucket. Each file's ETag and size are
the object's identity, so an object replaced in the bucket is another Remote, checked as a new version
under a new digest, and a download of a pinned one asks for that ETag (If-Match): a replaced object is
refused, never served under the old digest. A URL is taken only as urls.checked allows, and a refusal
shows it redacted. Credentials and endpoints come from obstore's own chain (AWS_* variables, instance
metadata, and so on), never from the URL, and are never logged. Needs obstore (`pip install
'mstar-lora[objects]'`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass
from datetime import timedelta
from functools import lru_cache
from pathlib import Path
from typing import Any

from . import urls
from .checkpoint import CONFIG, WEIGHTS

SCHEMES = tuple(f"{s}://" for s in urls.SCHEMES)
FILES = (CONFIG, WEIGHTS)  # all that a local adapter folder is read from
CHUNK = 1 << 20  # a download shows its progress on disk at least every MiB: a process waiting on it looks there
MODIFIED = "last-modified "  # a pin's tag where the store gives no ETag
IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S*")  # a URL in an error's text, to its first space
TOTAL = timedelta(hours=1)  # a request's bound in all (a 10 GB file at 3 MB/s); a stall's is MSTAR_LORA_OBJECT_TIMEOUT


@dataclass(frozen=True)
class Remote:
    """One adapter's folder in object storage as it was when pinned: its URL (ending in /) and, for each of
    its files, (name, ETag, size). Two pins of a folder whose objects were replaced between them differ."""

    url: str
    objects: tuple[tuple[str, str, int], ...]

    def __post_init__(self) -> None:
        if urls.checked(self.url) != self.url:
            raise ValueError(f"a Remote's URL is a checked prefix ending in '/' ({urls.checked(self.url)})")
        shape = [(n, type(t), type(size)) for n, t, size in self.objects] if all(
            isinstance(o, tuple) and len(o) == 3 for o in self.objects) else None
        if shape != [(n, str, int) for n in FILES] or any(size < 0 for _, _, size in self.objects):
            raise ValueError(f"a Remote's objects are ({', '.join(FILES)}), each (name, tag, size >= 0), in that "
                             "order, as pin makes them: the files a folder is read from and no other path")

    def __str__(self) -> str:
        return self.url

    @property
    def nbytes(self) -> int:
        return sum(size for _, _, size in self.objects)


def is_remote(source: object) -> bool:
    """Whether source is an object-store source: a Remote, or text written as a URL (checked as one, so that
    an unsupported scheme is refused as such, its URL redacted, and not looked up as a path)."""
    return isinstance(source, Remote) or urls.is_url(source)


def store_for(url: str) -> Any:
    """obstore's store for the bucket and prefix url names (one a prefix, reused: it pools its connections)."""
    return _store(url.rstrip("/"))  # no '/' of its own: an HTTP store joins a file's path with one


@lru_cache(maxsize=64)
def _store(url: str) -> Any:
    try:
        from obstore.store import from_url
    except ImportError:
        raise ValueError("an object-store URL needs obstore (pip install 'mstar-lora[objects]')") from None
    # AWS_ALLOW_HTTP (an endpoint on plain http, a local S3 server's) passed as the client option it is: obstore
    # reads its client options' variables when it is imported, not when a store is made. The timeout bounds a
    # stall (between two reads, the headers' wait too), not a request: a large file takes what it takes, and
    # a whole request is bounded by TOTAL only
    return from_url(url, client_options={"read_timeout": os.environ.get("MSTAR_LORA_OBJECT_TIMEOUT", "30s"),
                                         "timeout": TOTAL, "connect_timeout": "5s",
                                         "allow_http": os.environ.get("AWS_ALLOW_HTTP", "false")},
                    retry_config={"max_retries": 2, "backoff": {"init_backoff": timedelta(milliseconds=50),
                                                                "max_backoff": timedelta(seconds=1), "base": 2},
                                  "retry_timeout": timedelta(seconds=10)})


def pin(url: str) -> Remote:
    """url's adapter files as they are now, each its ETag and size from a HEAD (a ValueError that says why
    not, without repeating url)."""
    url = urls.checked(url)
    heads = {name: _head(url, name) for name in FILES}
    return Remote(url, tuple((name, _tag(meta), meta["size"]) for name, meta in heads.items()))


def _tag(meta: dict[str, Any]) -> str:
    """An object's version as its store tells it: its ETag, or where it gives none (a plain HTTP server),
    its Last-Modified time, written so that it cannot be taken for an ETag (which starts with a quote)."""
    if meta.get("e_tag"):
        return meta["e_tag"]
    return f"{MODIFIED}{meta['last_modified'].isoformat()}" if meta.get("last_modified") else ""


def has_adapter(url: str) -> bool:
    """Whether url holds an adapter's config (a resolver's cheap question before a pin): one HEAD."""
    try:
        _head(urls.checked(url), CONFIG)
    except Missing:
        return False
    return True


def _head(url: str, name: str) -> dict[str, Any]:
    """url's object name as a HEAD gives it (ETag, size); Missing if there is none, else a ValueError."""
    import obstore
    from obstore.exceptions import NotFoundError

    try:
        return obstore.head(store_for(url), name)
    except (NotFoundError, FileNotFoundError):  # obstore raises either for a 404
        raise Missing(f"no adapter there: no {name} under it (an adapter is {CONFIG} and {WEIGHTS} beside "
                      "it, as PEFT saves one)") from None
    except Exception as e:
        raise ValueError(f"{name} could not be looked up ({short(e)})") from None


class Missing(ValueError):
    """No such object: a refusal of the source, and to a resolver, no adapter there."""


def download(remote: Remote, name: str, etag: str, size: int, dest: Path) -> None:
    """One pinned object into dest, whole or not at all: a ValueError if it was replaced since its pin, came
    short or long, the store failed, or the local disk could not take it (saying why, never where: dest is
    in a temporary folder of the disk tier's)."""
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    try:
        with open(tmp, "wb") as f:
            got = 0
            for chunk in _chunks(remote, name, etag):
                got += len(chunk)
                if got > size:
                    break
                f.write(chunk)
        if got != size:
            raise ValueError(f"{name} came with {got} bytes, not the {size} it was pinned with")
        os.replace(tmp, dest)
    except OSError as e:  # the local disk's (full, unwritable, a name too long): the store's are ValueErrors
        raise LocalDisk(f"{name} could not be written to the disk tier ({e.strerror or type(e).__name__})",
                        e.errno) from None
    finally:
        with suppress(OSError):
            tmp.unlink(missing_ok=True)


class LocalDisk(ValueError):
    """A download the local disk could not take; errno says why (ENOSPC: full)."""

    def __init__(self, text: str, errno: int | None) -> None:
        super().__init__(text)
        self.errno = errno


def _chunks(remote: Remote, name: str, etag: str) -> Iterator[bytes]:
    """name's bytes as the store streams them, asking for the pinned ETag; a ValueError saying why not."""
    import obstore
    from obstore.exceptions import NotFoundError, PreconditionError

    conditional = etag and not etag.startswith(MODIFIED)
    try:
        got = obstore.get(store_for(remote.url), name, options={"if_match": etag} if conditional else None)
        theirs = got.meta.get("e_tag") if conditional else _tag(got.meta)
        if etag and theirs and theirs != etag:  # a server or cache that ignores If-Match, or gives no ETag
            raise PreconditionError(theirs)
        yield from got.stream(min_chunk_size=CHUNK)
    except PreconditionError:
        raise ValueError(f"{name} was replaced in the store since it was checked (it is no longer {etag}): "
                         "the new object is a new version") from None
    except (NotFoundError, FileNotFoundError):
        raise ValueError(f"{name} was deleted from the store since it was checked") from None
    except Exception as e:
        raise ValueError(f"{name} could not be fetched ({short(e)})") from None


def short(e: BaseException) -> str:
    """An error's first line: obstore's carry the whole response and a debug dump after it. A URL in it (the
    endpoint's, which the client's chain gives) is shown as urls.redacted shows one: no user:password@, no
    query."""
    text = str(e).strip().splitlines()
    line = IN_TEXT.sub(lambda m: urls.redacted(m[0]), text[0]) if text else ""
    return f"{type(e).__name__}: {line[:300]}" if line else type(e).__name__
