"""A safetensors header's tensor entries: each one's dtype, shape and byte range checked as safetensors checks
them, and the data packed without gaps or overlaps, before anything trusts them.

Three ways in, one verdict: the entries msgspec decoded typed (header_typed.py), checked in one loop; the
entries of orjson's or the standard library's parse, in one loop that checks their types too; and, where
either finds anything wrong, _entry over each entry, which names the reason. A function of the entries alone.
"""

from __future__ import annotations

import functools
import math
from itertools import chain
from typing import TYPE_CHECKING, Any, NamedTuple

from .acyclic import untrack

if TYPE_CHECKING:
    import torch

# Module names run to a hundred characters or so; longer ones are refused, which bounds the work of
# matching them against a config's patterns.
MAX_NAME = 1024
# safetensors reads sizes as 64-bit unsigned integers: a larger one (the standard library reads any) is no size.
LARGEST_SIZE = 2**64 - 1
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


def checked_entries(raw: dict[str, object], data_start: int) -> tuple[dict[str, TensorEntry], int]:
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
            if kind is None:  # sized only once its sizes are known to be ints: int * str repeats the str
                if type(dtype) is not str or dtype not in ITEMSIZES or not all(_size(d) for d in shape):
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
    # every (dtype, *shape) was checked where first seen, so each shape's values are sizes; not their types,
    # compared here, not tested with isinstance: True == 1 == 1.0, so a bool or a float passes for a size
    if set(map(type, chain.from_iterable(shapes))) - {int}:
        return None
    if set(map(type, chain.from_iterable(offsets))) != {int}:
        return None
    untrack(kind[1] for kind in kinds.values())
    untrack(out.values())  # a str, sizes and ints: in no cycle, so out of the collector's passes (acyclic.py)
    return out, at


def _size(d: object) -> bool:
    """Whether d is a size as safetensors reads one: an int (not a bool) from 0 to 2**64 - 1."""
    return type(d) is int and 0 <= d <= LARGEST_SIZE


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
        if not _size(d):
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


def check_packing(tensors: dict[str, TensorEntry], data_start: int, data_size: int) -> None:
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


def typed_entries(typed: dict[str, Any], data_start: int) -> tuple[dict[str, TensorEntry], int] | None:
    """_well_formed's answer for entries msgspec decoded (header_typed.py), whose types it checked as it
    decoded them (every size and offset a non-negative int, two offsets, a known dtype): each distinct
    (dtype, shape) sized once and each entry's bytes against its size, in one loop; None where a name is too
    long or an entry's offsets do not hold its size (_entry then names which)."""
    if typed and max(map(len, typed)) > MAX_NAME:
        return None
    kinds: dict[tuple, int] = {}
    out, make, at = {}, tuple.__new__, 0
    for name, v in typed.items():
        dtype, shape = v.dtype, v.shape
        size = kinds.get((dtype, shape))  # shapes of ints alone, so equal keys are equal shapes
        if size is None:
            size = kinds[dtype, shape] = ITEMSIZES[dtype] * math.prod(shape)
        begin, end = v.data_offsets
        if end - begin != size:
            return None
        at = end if begin == at else -1
        out[name] = make(TensorEntry, (dtype, shape, data_start + begin, data_start + end))
    untrack(shape for _, shape in kinds)
    untrack(out.values())  # a str, sizes and ints: in no cycle, so out of the collector's passes (acyclic.py)
    return out, at

