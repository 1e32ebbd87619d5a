"""The safetensors header, read with bounded reads and checked before anything trusts it."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import blake3

from . import header_json, header_typed
from .header_entries import ITEMSIZES, TensorEntry, check_packing, checked_entries, torch_dtypes, typed_entries

if TYPE_CHECKING:
    from .source import FileSource

# The safetensors library refuses headers over 100 MB; an adapter's is a few hundred KB.
MAX_HEADER_BYTES = 100 * 1024 * 1024
# A Qwen3-30B-A3B adapter in per-expert modules has 37,248 tensors, a 235B one about 72,000: a header
# listing more is refused before it is parsed, so an absurd one costs milliseconds, not minutes.
MAX_TENSORS = 1 << 18
# Parsed headers kept, by the memory they hold: each is charged its bytes and TENSOR_BYTES a tensor, which
# covers its parse (about 570 bytes a tensor of a per-expert MoE header, measured) and what one deployment
# derives from it (grouped modules, inspections, plans, scalings: about 2 KB a tensor with them).
# tests/test_header_memory.py measures both against the charge.
TENSOR_BYTES = 3 * 1024
CACHE_BYTES = 512 * 1024 * 1024


def __getattr__(name: str) -> Any:
    if name == "DTYPES":
        return torch_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class Memo(OrderedDict):
    """What is derived from one header (its modules, inspections, plans, scalings per config), the least
    recent let go past MEMO entries: a header seen with ever new configs must not grow without bound."""

    def __setitem__(self, key: object, value: object) -> None:
        super().__setitem__(key, value)
        while len(self) > MEMO:
            self.popitem(last=False)


MEMO = 64


@dataclass(frozen=True)
class Header:
    """A checked header. Shared by every file whose first bytes are the same (read_header caches
    it), so it is never mutated; memo holds what is derived from it alone."""

    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int
    file_size: int
    memo: Memo = field(default_factory=Memo, compare=False, repr=False)
    prefix: bytes = field(default=b"", compare=False, repr=False)  # the file's first data_start bytes
    # What makes two headers one, for caches that must outlive this object: a digest of a file's prefix
    # (a cache of thousands keeps 32 bytes of each, not its megabytes), or the listing a header of pushed
    # tensors was made from.
    identity: object = field(default=None, compare=False, repr=False)


class NotSafetensors(ValueError):
    """A file whose first 8 bytes cannot be a safetensors header's length: text, a zip, anything else
    given a .safetensors name."""


def _not_safetensors(first: bytes, n: int) -> NotSafetensors | None:
    """Why a file whose header length n is over the limit is no safetensors file at all, where its first
    bytes show it: text, a zip, or a length no file could have."""
    if first.startswith(b"PK\x03\x04"):
        what = "it is a zip archive, as torch.save writes"
    elif all(32 <= b < 127 or b in b"\t\n\r" for b in first):
        what = f"it begins with text, {first!r}"
    elif n >= 1 << 48:
        what = f"its first 8 bytes, {first!r}, read as a header length of {n} bytes"
    else:
        return None
    return NotSafetensors(f"not a safetensors file: {what}")


def parse_header(prefix: bytes, file_size: int) -> Header:
    """The header of a file of file_size bytes whose first bytes are prefix (8 + its length).

    Raises ValueError with the reason for anything a well-formed file would not have: the
    data must be exactly the tensors, packed without gaps or overlaps, as safetensors writes it.
    """
    if file_size < 8 or len(prefix) < 8:
        raise ValueError(f"{file_size} bytes is too short for a safetensors file")
    n = int.from_bytes(prefix[:8], "little")
    if n > MAX_HEADER_BYTES:
        raise _not_safetensors(prefix[:8], n) or ValueError(
            f"header length {n} is over the {MAX_HEADER_BYTES}-byte limit")
    if 8 + n > file_size:
        raise ValueError(f"header length {n} runs past the end of the {file_size}-byte file")
    if len(prefix) < 8 + n:
        raise ValueError("header is truncated")
    text = prefix[8 : 8 + n]
    if text[:1] != b"{":
        raise ValueError("not a safetensors file: its header is not a JSON object")
    # Every tensor's entry is an object: counting braces bounds the tensors without parsing them.
    if text.count(b"{") > 2 * MAX_TENSORS:
        raise ValueError(f"its header lists more than {MAX_TENSORS} tensors")
    with header_json.no_collection():
        return _parse(text, prefix[: 8 + n], file_size)


def _parse(text: bytes, head: bytes, file_size: int, fast: bool = True) -> Header:
    data_start = len(head)
    typed = header_typed.decode(text, tuple(ITEMSIZES)) if fast else None
    found = typed_entries(typed[0], data_start) if typed is not None else None
    if found is not None:  # msgspec's entries, checked: only their sizes against their offsets were left
        entries, metadata, exact = typed[0], typed[1], False
        keys = len(entries) + (metadata is not None)
    else:
        parsed = header_json.parse(text, fast)
        entries, exact = parsed.value, parsed.exact
        if not isinstance(entries, dict):
            raise ValueError("header is not a JSON object")
        keys = len(entries)
        metadata = entries.pop("__metadata__", None)
    if keys > MAX_TENSORS + 1:
        raise ValueError(f"its header lists {keys - 1} tensors, over the {MAX_TENSORS} this pool reads")
    if metadata is None:  # absent, or null as safetensors allows
        metadata = {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise ValueError("__metadata__ is not a string-to-string map")
    tensors, end = found if found is not None else checked_entries(entries, data_start)
    strings = [*entries, *metadata, *metadata.values()]  # with the dtypes and the entries' keys, colon-free
    if not exact and not header_json.colons_agree(text, keys + 3 * len(entries) + len(metadata), strings):
        return _parse(text, head, file_size, fast=False)  # a key written twice: the exact parse names it
    if end != file_size - data_start:  # not listed in file order, packed from its first byte to its last
        check_packing(tensors, data_start, file_size - data_start)
    return Header(tensors, metadata, data_start, file_size, prefix=head,
                  identity=(blake3.blake3(head).digest(), file_size))


def read_header(source: FileSource | str | os.PathLike[str]) -> Header:
    """The checked header of the safetensors file open as source (or at a path), reading no more than
    it declares."""
    if not hasattr(source, "read_into"):
        from .source import FileSource

        opened = FileSource(source)
        try:
            return read_header(opened)
        finally:
            opened.close()
    head = source.read(8, 0)
    n = int.from_bytes(head, "little") if len(head) == 8 else 0
    if len(head) == 8 and n <= MAX_HEADER_BYTES and 8 + n <= source.size:
        head += source.read(n, 8)
    return cached_header(head, source.size)


def held_bytes(header: Header) -> int:
    """What a parsed header and what is derived from it are charged in the cache: its bytes, and
    TENSOR_BYTES a tensor."""
    return len(header.prefix) + TENSOR_BYTES * len(header.tensors)


class _Cache:
    """Parsed headers by their bytes, least recent dropped past limit bytes of memory held (held_bytes).
    Adapters trained with one recipe (same modules, ranks, dtype) have byte-identical headers: a
    deployment's startup check parses and inspects each distinct header once. A header whose adapter is
    refused is let go (forget), so refused files, however many, keep no memory."""

    def __init__(self, limit: int) -> None:
        self.limit, self.nbytes = limit, 0
        self._headers: OrderedDict[tuple[bytes, int], tuple[Header, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, prefix: bytes, file_size: int) -> Header:
        key = (prefix, file_size)
        with self._lock:
            if key in self._headers:
                self._headers.move_to_end(key)
                return self._headers[key][0]
        header = parse_header(prefix, file_size)  # a refused header raises, and is not kept
        charge = held_bytes(header)
        with self._lock:
            if key not in self._headers and charge <= self.limit:
                self._headers[key] = (header, charge)
                self.nbytes += charge
                while self.nbytes > self.limit:
                    _, (_, old) = self._headers.popitem(last=False)
                    self.nbytes -= old
            return self._headers.get(key, (header,))[0]

    def forget(self, header: Header) -> None:
        with self._lock:
            key = (header.prefix, header.file_size)
            kept = self._headers.get(key)
            if kept is not None and kept[0] is header:
                del self._headers[key]
                self.nbytes -= kept[1]

    def __len__(self) -> int:
        with self._lock:
            return len(self._headers)

    def clear(self) -> None:
        with self._lock:
            self._headers.clear()
            self.nbytes = 0


_HEADERS = _Cache(CACHE_BYTES)


def cached_header(prefix: bytes, file_size: int) -> Header:
    """parse_header, once per distinct header bytes and file size while the cache keeps it."""
    return _HEADERS.get(prefix, file_size)


def forget(header: Header) -> None:
    """Let the cache go of header (its adapter was refused): its parse and all derived from it are freed
    once its checkpoint is."""
    _HEADERS.forget(header)
