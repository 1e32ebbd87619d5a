"""Object-store URLs as sources: a scheme obstore reads, a bucket or host, and a path that names one prefix
and nothing outside it.

A URL parser may undo what a check of the text saw: obstore decodes %2e%2e to '..' and then steps back a
segment, and URL parsers drop tabs and newlines and read '\\' as '/' in http(s). So each segment is checked
as the store will read it, decoded: no '.' or '..', no empty segment, no encoded '/', '\\' or '%', no
control or format character; and a query or fragment, which names no object, is refused rather than kept
in the pin, the folder's hash and the listing.
"""

from __future__ import annotations

import re
import unicodedata
from urllib.parse import unquote

SCHEMES = ("s3", "gs", "az", "abfs", "https", "http")
LONGEST = 2048  # characters: an S3 key is at most 1,024 bytes
SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
BUCKET = re.compile(r"[A-Za-z0-9_.-]+")
HOST = re.compile(r"(?:[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?")  # http(s): a name or [IPv6], a port
ESCAPE = re.compile(r"%[0-9A-Fa-f]{2}")


def is_url(source: object) -> bool:
    """Whether source is written as a URL (scheme://...), whatever its scheme: one checked as a URL."""
    return isinstance(source, str) and SCHEME.match(source) is not None


def checked(url: str) -> str:
    """url as the prefix it names, ending in '/'; else a ValueError saying why it cannot be a source,
    without repeating url."""
    if len(url) > LONGEST:
        raise ValueError(f"its URL is {len(url)} characters long, over the {LONGEST} an object-store URL may be")
    found = SCHEME.match(url)
    scheme = url[:found.end() - 3].lower() if found else ""
    if scheme not in SCHEMES:
        raise ValueError(f"{scheme + '://' if scheme else 'it'} is not an object store obstore reads "
                         f"({', '.join(s + '://' for s in SCHEMES)})")
    rest = url[found.end():]
    if "?" in rest or "#" in rest:
        raise ValueError("its URL has a query or fragment ('?' or '#'), which names no object")
    host, _, path = rest.partition("/")
    if not (HOST if scheme.startswith("http") else BUCKET).fullmatch(host):
        raise ValueError(f"its {'host' if scheme.startswith('http') else 'bucket'} is not a plain name "
                         "(ASCII letters, digits, '.', '-' and '_')")
    segments = path.split("/")
    if segments[-1] == "":
        segments.pop()  # the prefix's own trailing '/'
    for segment in segments:
        why = unsafe(segment)
        if why:
            raise ValueError(f"its path has {why}: a prefix names what lies under it and nothing outside")
    return f"{scheme}://{host}/" + "".join(f"{s}/" for s in segments)


def unsafe(segment: str) -> str | None:
    """What makes one path segment name something other than itself once decoded, or None."""
    if not segment:
        return "an empty segment ('//')"
    if any(unicodedata.category(c)[0] in "CZ" or c == "\\" for c in segment):
        return "a space, control or format character, or '\\' (a URL parser drops or rereads them)"
    if segment.count("%") != len(ESCAPE.findall(segment)):
        return "a '%' that is not an escape of two hex digits"
    try:
        decoded = unquote(segment, errors="strict")
    except UnicodeDecodeError:
        return "an escape that is not UTF-8"
    if decoded in (".", ".."):
        return f"a {decoded!r} segment (encoded or not)"
    if any(c in "/\\%" for c in decoded):
        return "an encoded '/', '\\' or '%'"
    if any(unicodedata.category(c)[0] == "C" for c in decoded):
        return "an encoded control or format character"
    return None
