"""Objects that can hold no reference cycle, kept out of the cyclic garbage collector's passes.

A per-expert header holds tens of thousands of entries, each a tuple subclass (TensorEntry, Location) of a
string, a tuple of sizes and integers. The collector untracks a plain tuple of such values on its first pass
over it, but never a subclass's instance, so each one a held header keeps is walked again in every full pass
over the process's heap (and each cold read's are walked by the young passes that move them there). None can
be in a cycle: its items are immutable and refer to nothing that refers back. untrack marks them untracked as
the collector marks a plain tuple of integers (CPython's PyObject_GC_UnTrack); the collector's settings and
state, which are the host process's, are left as they are. Elsewhere (an interpreter without that call) it does
nothing and the collector walks them as before.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Iterable

_untrack = None
if sys.implementation.name == "cpython":
    try:
        import ctypes

        _untrack = ctypes.pythonapi.PyObject_GC_UnTrack
        _untrack.argtypes, _untrack.restype = [ctypes.py_object], None
    except (ImportError, AttributeError, OSError):  # no ctypes, or no such symbol: the collector walks them
        _untrack = None


def untrack(objects: Iterable[object]) -> None:
    """Take objects, each of which holds only strings, numbers, None and tuples of them (or other such
    objects), out of the collector's passes. The caller vouches for what they hold: an object untracked that
    is part of a cycle would keep that cycle from ever being freed."""
    if _untrack is not None:
        deque(map(_untrack, objects), maxlen=0)
