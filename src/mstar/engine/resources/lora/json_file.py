"""JSON files a deployment names (a model config, a serving config, adapter_config.json), read so that a
hostile one is a ValueError with the reason: a regular file only, opened without blocking, its size bounded
and its nesting too."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from typing import Any

# Configs are kilobytes; 16 MiB is far past any real one and still cheap to refuse.
MAX_JSON_BYTES = 16 * 1024 * 1024


def _regular_file(path: str | os.PathLike[str]) -> None:
    """Raise ValueError unless path is a regular file: a FIFO would block its reader forever and a device
    (/dev/zero) never ends."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise ValueError(f"unreadable ({e.strerror or e})") from None
    if stat.S_ISDIR(mode):
        raise ValueError("a directory, not a file")
    if not stat.S_ISREG(mode):
        raise ValueError("not a regular file (a FIFO, socket or device)")


def read_json(path: str | os.PathLike[str], *, limit: int = MAX_JSON_BYTES,
              object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None) -> Any:
    """The JSON value in the file at path; a ValueError's message says what the file is instead
    ("not valid JSON (...)"), to follow "<its name> is"."""
    _regular_file(path)  # stat first, so a device is never opened
    # O_NONBLOCK: a FIFO swapped in after the stat opens at once, and fstat then refuses it
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise ValueError(f"unreadable ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file (a FIFO, socket or device)")
        data = _read_all(fd, limit + 1, st.st_size + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ValueError(f"over {limit // (1024 * 1024)} MiB, far past any config")
    return parse_json(data, object_pairs_hook=object_pairs_hook)


def _read_all(fd: int, most: int, size: int) -> bytes:
    """Up to most bytes of an open file, read until it ends: size (what fstat said, and one more) at first,
    so a regular file comes in one read, then 64 KiB at a time for one that grew (or says 0, as /proc's do)."""
    parts, got = [], 0
    try:
        while got < most:
            part = os.read(fd, min(most - got, size if not parts else 1 << 16))
            if not part:
                break
            parts.append(part)
            got += len(part)
    except OSError as e:  # /proc/self/mem is a "regular file" too
        raise ValueError(f"unreadable ({e.strerror or e})") from None
    return parts[0] if len(parts) == 1 else b"".join(parts)


def parse_json(data: bytes | str, *, object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None) -> Any:
    """data parsed as JSON; ValueError for text that is not JSON, not UTF-8, or nested past what the parser
    can follow (100000 [ would otherwise be a RecursionError)."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        return json.loads(text, object_pairs_hook=object_pairs_hook)
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text ({e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e})") from None
    except ValueError as e:  # an integer of thousands of digits, past Python's limit for reading one
        raise ValueError(f"not JSON this pool reads ({e})") from None
    except RecursionError:
        raise ValueError("nested too deeply to read as JSON") from None
