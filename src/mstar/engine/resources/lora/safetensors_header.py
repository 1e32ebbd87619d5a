"""The safetensors header, read with bounded reads and checked before anything trusts it."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

# The safetensors library refuses headers over 100 MB; an adapter's is a few hundred KB.
MAX_HEADER_BYTES = 100 * 1024 * 1024

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
ITEMSIZES = {name: dtype.itemsize for name, dtype in DTYPES.items()}


class TensorEntry(NamedTuple):
    """One tensor's dtype, shape and absolute byte range in its file (a tuple: headers hold hundreds)."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Header:
    """A checked header. Shared by every file whose first bytes are the same (read_header caches
    it), so it is never mutated; memo holds what is derived from it alone."""

    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int
    file_size: int
    memo: dict = field(default_factory=dict, compare=False, repr=False)


def parse_header(prefix: bytes, file_size: int) -> Header:
    """The header of a file of file_size bytes whose first bytes are prefix (8 + its length).

    Raises ValueError with the reason for anything a well-formed file would not have: the
    data must be exactly the tensors, packed without gaps or overlaps, as safetensors writes it.
    """
    if file_size < 8 or len(prefix) < 8:
        raise ValueError(f"{file_size} bytes is too short for a safetensors file")
    n = int.from_bytes(prefix[:8], "little")
    if n > MAX_HEADER_BYTES:
        raise ValueError(f"header length {n} is over the {MAX_HEADER_BYTES}-byte limit")
    if 8 + n > file_size:
        raise ValueError(f"header length {n} runs past the end of the {file_size}-byte file")
    if len(prefix) < 8 + n:
        raise ValueError("header is truncated")
    try:
        raw = json.loads(prefix[8 : 8 + n].decode("utf-8"), object_pairs_hook=_unique)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"header is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError("header is not a JSON object")
    data_start = 8 + n
    metadata = raw.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise ValueError("__metadata__ is not a string-to-string map")
    tensors = {name: _entry(name, value, data_start) for name, value in raw.items()}
    _check_packing(tensors, data_start, file_size - data_start)
    return Header(tensors, metadata, data_start, file_size)


def _unique(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out = dict(pairs)
    if len(out) != len(pairs):
        dup = next(k for i, (k, _) in enumerate(pairs) if k in dict(pairs[:i]))
        raise json.JSONDecodeError(f"key {dup!r} appears twice", "", 0)
    return out


def _entry(name: str, value: object, data_start: int) -> TensorEntry:
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


def read_header(path: str | os.PathLike[str]) -> Header:
    """The checked header of the safetensors file at path, reading no more than it declares."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        if len(head) == 8 and n <= MAX_HEADER_BYTES and 8 + n <= size:
            head += f.read(n)
    return _parse_cached(bytes(head), size)


@functools.lru_cache(maxsize=64)  # an 8B model's header and what is derived from it: about 200 KB
def _parse_cached(prefix: bytes, file_size: int) -> Header:
    # Adapters trained with one recipe (same modules, ranks, dtype) have byte-identical headers:
    # a deployment's startup check parses and inspects each distinct header once.
    return parse_header(prefix, file_size)
