"""Object-store URLs as sources: a scheme obstore reads, a bucket or host, and a path that names one prefix
and nothing outside it.

A URL parser may undo what a check of the text saw: obstore decodes %2e%2e to '..' and then steps back a
segment, and URL parsers drop tabs and newlines and read '\\' as '/' in http(s). So each segment is checked
as the store will read it, decoded: no '.' or '..', no empty segment, no encoded '/', '\\' or '%', no
control or format character; and a query or fragment, which names no object, is refused rather than kept
in the pin, the folder's hash and the listing.

A URL carries no credentials: user:password@ or a signed query (X-Amz-Signature=...) is refused, and a
refusal shows the URL redacted, since whatever it holds would otherwise stand in errors, logs and
listings. Credentials come from the client's standard chain. An '@' is a credential's only before the
path: in a bucket's key (s3://bucket/team@x/adapter/) it is a name, taken and shown as it is, where the
bucket is a plain name (a user:pass/word@bucket, a secret with a '/' in it, is no plain bucket). An http(s)
path takes none: host:1234/word@host would pass for a host and port.
"""

from __future__ import annotations

import re
import unicodedata
from urllib.parse import unquote

SCHEMES = ("s3", "gs", "az", "abfs", "https", "http")
LONGEST = 2048  # characters: an S3 key is at most 1,024 bytes
SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
# what is taken for a URL, to be checked (and refused, redacted) as one: scheme:/ (but a drive, C:/), or one
# of SCHEMES and a colon however it goes on: never looked up as a local path, whose refusal would echo it
URLISH = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:/|(?:s3|gs|az|abfs|https?):", re.IGNORECASE)
BUCKET = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
HOST = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9_.-]*|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?")  # a name or [IPv6], a port
ABFS = re.compile(r"[a-z0-9-]{3,63}@[A-Za-z0-9_.-]+")  # abfs://container@account.dfs.core.windows.net/
ESCAPE = re.compile(r"%[0-9A-Fa-f]{2}")
CHAIN = ("credentials come from the client's standard chain (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
         "AWS_SESSION_TOKEN and the other AWS_* variables; GOOGLE_APPLICATION_CREDENTIALS; AZURE_STORAGE_*; "
         "instance metadata), never from a URL, which would show in errors and listings")
SHOWN = 300  # characters of a URL a refusal shows


def is_url(source: object) -> bool:
    """Whether source is written as a URL (scheme://..., or near it), whatever its scheme: one checked as a
    URL."""
    return isinstance(source, str) and URLISH.match(source) is not None


def redacted(url: str) -> str:
    """url as a message may show it: what precedes an '@' (user:password) as ***, a host or bucket that is no
    plain name as ***, the query and fragment dropped, unprintable characters escaped, at most SHOWN
    characters."""
    found = SCHEME.match(url)
    head, rest = (url[:found.end()], url[found.end():]) if found else ("", url)
    hidden = "@" in rest and not _keyed(head[:-3].lower(), rest)
    if hidden:
        before, _, rest = rest.rpartition("@")
        if "?" in before or "#" in before:  # what follows the '@' may be the query's
            rest = ""
    host, slash, path = rest.split("?", 1)[0].split("#", 1)[0].partition("/")
    if host and not HOST.fullmatch(host):
        host, hidden = "", True
    shown = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in f"{head}{'***@' * hidden}{host}{slash}{path}")
    return shown if len(shown) <= SHOWN else shown[:SHOWN] + "..."


def checked(url: str) -> str:
    """url as the prefix it names, ending in '/'; else a ValueError saying why it cannot be a source,
    without repeating url."""
    if len(url) > LONGEST:
        raise ValueError(f"its URL is {len(url)} characters long, over the {LONGEST} an object-store URL may be")
    found = SCHEME.match(url)
    if not found:
        raise ValueError(f"its URL is not written scheme://bucket/path ({', '.join(s + '://' for s in SCHEMES)})")
    scheme = url[:found.end() - 3].lower()
    if scheme not in SCHEMES:
        raise ValueError(f"{scheme}:// is not an object store obstore reads ({', '.join(s + '://' for s in SCHEMES)})")
    rest = url[found.end():]
    host, _, path = rest.partition("/")
    if "@" in rest and not _keyed(scheme, rest):
        raise ValueError(f"its URL carries credentials (user:password@, or an '@' before a bucket's path or in an "
                         f"http(s) URL): {CHAIN}")
    if "?" in rest:
        raise ValueError(f"its URL has a query ('?'), which names no object, and a signature or token there is "
                         f"a credential: {CHAIN}")
    if "#" in rest:
        raise ValueError("its URL has a fragment ('#'), which names no object")
    if not (HOST if scheme.startswith("http") else ABFS if "@" in host else BUCKET).fullmatch(host):
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


def _keyed(scheme: str, rest: str) -> bool:
    """Whether each '@' in rest (a URL after its scheme) is in a bucket's key, or an abfs container's at its
    account: no credential."""
    host = rest.partition("/")[0].split("?", 1)[0].split("#", 1)[0]
    if scheme in ("http", "https") or "?" in rest or "#" in rest:
        return False
    return ABFS.fullmatch(host) is not None if scheme == "abfs" and "@" in host else \
        BUCKET.fullmatch(host) is not None


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
