"""A safetensors header's JSON, parsed once, fast and exactly.

orjson (the optional extra "fast") parses a header about twice as fast as the standard library, but keeps the
last of two equal keys where a header must have none. So it parses a header only where every key the text
holds can be counted afterwards: with no backslash in the text every string is its own bytes, and the text's
colons are exactly one per key kept plus the colons inside the strings kept, unless a key was written twice
(which adds a colon nothing kept accounts for). Any other header, and any that orjson refuses, is parsed by
the standard library with a hook that refuses a key written twice, so both say the same of every header.
"""

from __future__ import annotations

import gc
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

try:
    import orjson
except ImportError:  # the extra is optional: the standard library reads every header alike, slower
    orjson = None


class Parsed:
    """A header's JSON object, and whether equal keys written twice are already ruled out."""

    __slots__ = ("exact", "value")

    def __init__(self, value: object, exact: bool) -> None:
        self.value, self.exact = value, exact


def parse(text: bytes, fast: bool = True) -> Parsed:
    """text's JSON value (ValueError naming why it is none); by orjson where fast and installed and the
    text has no escapes, whose caller then rules out keys written twice with colons_agree."""
    if fast and orjson is not None and b"\\" not in text:
        try:
            return Parsed(orjson.loads(text), exact=False)
        except orjson.JSONDecodeError:
            pass  # the standard library names the reason, or reads what orjson does not (NaN, huge integers)
    try:
        return Parsed(json.loads(text.decode("utf-8"), object_pairs_hook=_unique), exact=True)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"header is not valid JSON ({e})") from None


def colons_agree(text: bytes, keys: int, strings: list[str]) -> bool:
    """Whether text, with no escapes, holds no key but the keys (a count) kept: its colons are one per key
    plus those of the strings kept (every string the text holds, keys and values)."""
    return text.count(b":") == keys + "".join(strings).count(":")


def _unique(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out = dict(pairs)
    if len(out) != len(pairs):
        dup = next(k for i, (k, _) in enumerate(pairs) if k in dict(pairs[:i]))
        raise json.JSONDecodeError(f"key {dup!r} appears twice", "", 0)
    return out


_pause = {"depth": 0, "enabled": False}
_lock = threading.Lock()


@contextmanager
def no_collection() -> Iterator[None]:
    """The cyclic garbage collector held off while a header's hundreds of thousands of acyclic objects are
    made: it would walk them all again and again (a header of 37,248 tensors parses 2.5x faster without it).
    Nested and threaded alike (tests/test_collector.py): the collector's switch is the process's, so reads on
    several threads share one pause, counted under a lock; one thread's read ending leaves it off under the
    others', and it is turned back on once the last is over, on an error as on success, only if it was on
    before the first began (a host that runs with it off finds it off). What a host does to the switch while a
    read holds it cannot be told from the read's own: turned on, it stays on; turned off, it is on again after
    the last read. Reads that overlap without a pause between hold collection off for as long: their own
    objects are acyclic and freed by their counts, but the host's cycles wait for the first moment none runs."""
    with _lock:
        if _pause["depth"] == 0:
            _pause["enabled"] = gc.isenabled()
            gc.disable()
        _pause["depth"] += 1
    try:
        yield
    finally:
        with _lock:
            _pause["depth"] -= 1
            if _pause["depth"] == 0 and _pause["enabled"]:
                gc.enable()
