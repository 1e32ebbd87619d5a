"""The safetensors header, read with bounded reads and checked before anything trusts it."""

from __future__ import annotations

import functools
import math
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING, Any, NamedTuple

import blake3

from . import header_json
from .acyclic import untrack

if TYPE_CHECKING:
    import torch

    from .source import FileSource

# The safetensors library refuses headers over 100 MB; an adapter's is a few hundred KB.
MAX_HEADER_BYTES = 100 * 1024 * 1024
# A Qwen3-30B-A3B adapter in per-expert modules has 37,248 tensors, a 235B one about 72,000: a header
# listing more is refused before it is parsed, so an absurd one costs milliseconds, not minutes.
MAX_TENSORS = 1 << 18
# Module names run to a hundred characters or so; longer ones are refused, which bounds the work of
# matching them against a config's patterns.
MAX_NAME = 1024
# Parsed headers kept, by the memory they hold: each is charged its bytes and TENSOR_BYTES a tensor, which
# covers its parse (about 570 bytes a tensor of a per-expert MoE header, measured) and what one deployment
# derives from it (grouped modules, inspections, plans, scalings: about 2 KB a tensor with them).
# tests/test_header_memory.py measures both against the charge.
TENSOR_BYTES = 3 * 1024
CACHE_BYTES = 512 * 1024 * 1024

# Each safetensors dtype's torch name and size: what a header is checked and sized by, without torch (the
# startup check imports none); DTYPES, the torch dtypes themselves, is made on first use.
TORCH_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
               "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
               "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
ITEMSIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
             "F8_E4M3": 1, "F8_E5M2": 1}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})


@functools.cache
def torch_dtypes() -> dict[str, torch.dtype]:
    """Each safetensors dtype's torch dtype (importing torch)."""
    import torch

    return {code: getattr(torch, n) for code, n in TORCH_NAMES.items()}


def __getattr__(name: str) -> Any:
    if name == "DTYPES":
        return torch_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class TensorEntry(NamedTuple):
    """One tensor's dtype, shape and absolute byte range in its file (a tuple: headers hold hundreds)."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtypes()[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


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
    parsed = header_json.parse(text, fast)
    raw = parsed.value
    if not isinstance(raw, dict):
        raise ValueError("header is not a JSON object")
    if len(raw) > MAX_TENSORS + 1:
        raise ValueError(f"its header lists {len(raw) - 1} tensors, over the {MAX_TENSORS} this pool reads")
    data_start, keys = len(head), len(raw)
    metadata = raw.pop("__metadata__", None)
    if metadata is None:  # absent, or null as safetensors allows
        metadata = {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise ValueError("__metadata__ is not a string-to-string map")
    tensors, end = _entries(raw, data_start)
    strings = [*raw, *metadata, *metadata.values()]  # with the dtypes and the entries' keys, colon-free
    if not parsed.exact and not header_json.colons_agree(text, keys + 3 * len(raw) + len(metadata), strings):
        return _parse(text, head, file_size, fast=False)  # a key written twice: the exact parse names it
    if end != file_size - data_start:  # not listed in file order, packed from its first byte to its last
        _check_packing(tensors, data_start, file_size - data_start)
    return Header(tensors, metadata, data_start, file_size, prefix=head,
                  identity=(blake3.blake3(head).digest(), file_size))


def _entries(raw: dict[str, object], data_start: int) -> tuple[dict[str, TensorEntry], int]:
    """Every entry checked as _entry checks one, in one pass over them all where all are well formed (each
    distinct dtype and shape sized once); where one is not, _entry finds it and says why. With them, where
    the data ends if the entries are listed in file order, each beginning where the last ended from the
    data's first byte (as safetensors writes them), else -1."""
    fast = _well_formed(raw, data_start)
    if fast is not None:
        return fast
    entries = {name: _entry(name, value, data_start) for name, value in raw.items()}
    untrack(entries.values())
    return entries, -1


def _well_formed(raw: dict[str, object], data_start: int) -> tuple[dict[str, TensorEntry], int] | None:
    """_entry's entries where every one is well formed, else None: one pass over the entries (a per-expert
    header's tens of thousands are scattered objects, and each pass over them all is a walk through memory
    that costs more than the work done on the way), each distinct (dtype, *shape) checked and sized once,
    then the sizes' and offsets' types checked over two flat lists at C speed. The types are checked there
    and not by the sizes' cache: True == 1 == 1.0 as keys, so a bool or a float for a size would pass for an
    int that came first."""
    if not raw:
        return {}, 0
    at = 0  # where the data ends, while every entry begins where the last ended (-1 once one does not)
    kinds: dict[tuple, tuple[int, tuple[int, ...]]] = {}
    out, shapes, offsets = {}, [], []
    make, add_shape, add_offsets = tuple.__new__, shapes.append, offsets.append
    try:
        for name, v in raw.items():
            if type(v) is not dict or len(v) != 3 or len(name) > MAX_NAME:
                return None
            dtype, shape, bounds = v["dtype"], v["shape"], v["data_offsets"]
            if type(shape) is not list or type(bounds) is not list or len(bounds) != 2:
                return None
            add_shape(shape)
            add_offsets(bounds)
            key = (dtype, *shape)
            kind = kinds.get(key)
            if kind is None:
                if type(dtype) is not str or dtype not in ITEMSIZES:
                    return None
                kind = kinds[key] = (ITEMSIZES[dtype] * math.prod(shape), tuple(shape))
            begin, end = bounds
            if end - begin != kind[0] or begin < 0:
                return None
            at = end if begin == at else -1
            # tuple.__new__ makes the entry in C; TensorEntry's own __new__ is a Python call a tensor
            out[name] = make(TensorEntry, (dtype, kind[1], data_start + begin, data_start + end))
    except (KeyError, TypeError):  # a key missing, a value unhashable or of no arithmetic
        return None
    # types compared, not tested with isinstance: True == 1, so a bool would pass for a size
    if set(map(type, chain.from_iterable(shapes))) - {int} or min(chain.from_iterable(shapes), default=0) < 0:
        return None
    if set(map(type, chain.from_iterable(offsets))) != {int}:
        return None
    untrack(kind[1] for kind in kinds.values())
    untrack(out.values())  # a str, sizes and ints: in no cycle, so out of the collector's passes (acyclic.py)
    return out, at


def _entry(name: str, value: object, data_start: int) -> TensorEntry:
    if len(name) > MAX_NAME:
        raise ValueError(f"tensor {name[:60]!r}...: a name of {len(name)} characters, over {MAX_NAME}")
    if type(value) is not dict or len(value) != 3:
        raise ValueError(f"tensor {name!r}: entry needs exactly dtype, shape and data_offsets")
    try:
        dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    except KeyError:
        raise ValueError(f"tensor {name!r}: entry needs exactly dtype, shape and data_offsets") from None
    itemsize = ITEMSIZES.get(dtype) if type(dtype) is str else None
    if itemsize is None:
        raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
    if type(shape) is not list:
        raise ValueError(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
    size = itemsize
    for d in shape:
        if type(d) is not int or d < 0:
            raise ValueError(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
        size *= d
    if type(offsets) is not list or len(offsets) != 2:
        raise ValueError(f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end]")
    begin, end = offsets
    if type(begin) is not int or type(end) is not int or begin < 0 or end < 0:
        raise ValueError(f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end]")
    if end - begin != size:
        raise ValueError(
            f"tensor {name!r}: data_offsets [{begin}, {end}] hold {end - begin} bytes, "
            f"its {dtype} {shape} needs {size}"
        )
    return TensorEntry(dtype, tuple(shape), data_start + begin, data_start + end)


def _check_packing(tensors: dict[str, TensorEntry], data_start: int, data_size: int) -> None:
    if _packed(list(tensors.values()), data_start, data_start + data_size):
        return
    at, prev = 0, None
    for name, e in sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].stop)):
        begin = e.start - data_start
        if begin < at:
            raise ValueError(f"tensor {name!r} overlaps tensor {prev!r}")
        if begin > at:
            raise ValueError(f"a gap of {begin - at} bytes lies before tensor {name!r}")
        at, prev = e.stop - data_start, name
    if at != data_size:
        what = "past the end of" if at > data_size else "short of"
        raise ValueError(f"tensor data ends at byte {at}, {what} the file's {data_size} data bytes")


def _packed(entries: list[TensorEntry], first: int, end: int) -> bool:
    """Whether the tensors, in order of (start, stop), each begin where the last ended, from first to end:
    the slow walk's answer, found by a sort and a comparison of whole arrays."""
    if not entries:
        return first == end
    starts, stops = [e.start for e in entries], [e.stop for e in entries]
    if starts[1:] != stops[:-1]:  # not in the file's order as listed: sorted as the walk sorts them
        if max(stops) >= 1 << 62:
            return False
        pairs = sorted(zip(starts, stops, strict=True))  # by start, then stop, as the walk sorts (no torch here)
        begin, finish = [p[0] for p in pairs], [p[1] for p in pairs]
        if begin[1:] != finish[:-1]:
            return False
        return begin[0] == first and finish[-1] == end
    return starts[0] == first and stops[-1] == end


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
