"""A safetensors header decoded by msgspec straight into typed entries (the optional extra "fast").

msgspec checks, as it decodes, what header_entries checks of orjson's dicts: each entry an object of exactly
dtype, shape and data_offsets, its dtype one this pool knows, every size and offset a non-negative integer
(never a bool or a float), and two offsets; and its entries are small objects the collector never tracks, made
and let go of at about half the cost of orjson's dicts and lists (a per-expert header's 37,248 entries in 40
ms, against 75). A header it reads is read as the other parses read it; one it refuses, or cannot take (a
backslash anywhere, metadata anywhere but first or written with spaces), goes to them, which name the reason.
Like orjson it keeps the last of two equal keys: the colon count (header_json.colons_agree) rules those out.
"""

from __future__ import annotations

import functools
import re
from typing import Annotated, Any, Literal

try:
    import msgspec
except ImportError:  # the extra is optional: orjson or the standard library reads every header alike
    msgspec = None

_STRING = rb'"[^"\\]*"'  # no escapes: a header with a backslash is not read here
_PAIR = _STRING + rb":" + _STRING
# The metadata as safetensors writes it, first and without spaces; then a comma and the next key, or the end.
_METADATA = re.compile(rb'\{"__metadata__":(\{(?:' + _PAIR + rb"(?:," + _PAIR + rb')*)?\})(,(?=[ \t\n\r]*")|\})')
# Sizes and offsets msgspec takes: those of 63 bits (the most its bounds can say); a larger one, up to the
# 64 bits safetensors reads and orjson parses as an integer, goes to orjson, as any other header does.
_LARGEST = 2**63 - 1


@functools.cache
def _decoders(dtypes: tuple[str, ...]) -> tuple[Any, Any]:
    size = Annotated[int, msgspec.Meta(ge=0, le=_LARGEST)]
    fields = [("dtype", Literal[dtypes]), ("shape", tuple[size, ...]), ("data_offsets", tuple[size, size])]
    entry = msgspec.defstruct("Entry", fields, forbid_unknown_fields=True, gc=False)
    return msgspec.json.Decoder(dict[str, entry]), msgspec.json.Decoder(dict[str, str])


def decode(text: bytes, dtypes: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, str] | None] | None:
    """(the entries by name, the metadata where the header has any) of a header's text, where msgspec reads it
    with entries of dtypes alone; None where it does not, or is not installed."""
    if msgspec is None or b"\\" in text:
        return None
    entries, metadata = _decoders(dtypes)
    found = _METADATA.match(text)
    try:
        if found is None:
            decoded, given = entries.decode(text), None
        else:
            body = b"{}" if found.group(2) == b"}" else b"{"
            decoded, given = entries.decode(body + text[found.end() :]), metadata.decode(found.group(1))
    except (msgspec.DecodeError, RecursionError, ValueError):  # ValueError: invalid UTF-8, say
        return None
    if "__metadata__" in decoded:  # an entry by that name, or a second metadata: the other parses say which
        return None
    return decoded, given
