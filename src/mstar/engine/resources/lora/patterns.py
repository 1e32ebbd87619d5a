"""PEFT's module-name patterns, matched with PEFT's rule in work and memory a config's pass bounds.

rank_pattern and alpha_pattern keys are regexes PEFT tries in order, `re.match(rf"(.*\\.)?({key})$",
name)`, the first that matches winning; target_modules and exclude_modules given as one string are
`re.fullmatch`ed. Python's re backtracks, so a key like `(.|.)*#` takes 2^31 steps on one module name:
a config is a file anyone may hand the startup check, and alternatives alone backtrack as badly
(`(\\w|[^#]|.)` two dozen times, then `#`). So a pattern that repeats, alternates or looks around is
matched as a set of states (automaton.py), in steps linear in the name; one with none of these is left
to re, which cannot blow up on it. A config's patterns together may unfold to at most
MAX_CONFIG_STATES states, and one pass of matching them against a model's module names (a Matching)
may take at most BASE_WORK + WORK_PER_CHAR steps a character of the names and hold MAX_BYTES in its
caches; a config past that is refused naming its costliest pattern, and nothing of a pass outlives it.
Keys made of names alone (letters, digits, _ and -, dots matching any character as in PEFT) are
found through an index, so a pattern per module (a rank_pattern AdaLoRA wrote) costs a few lookups
per module rather than one match per key.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence

from .automaton import Budget, Nfa

try:
    from re import _constants as C
    from re import _parser as sre_parse
except ImportError:  # Python 3.10
    import sre_constants as C
    import sre_parse

MAX_PATTERN = 1024  # characters in one pattern
MAX_STATES = 4096  # states a pattern may unfold to (x{64}{64} unfolds to 4,096)
MAX_CONFIG_STATES = 16_384  # states all of one config's patterns may unfold to
BASE_WORK = 1 << 21  # steps a pass of matching may take whatever the names (each about 0.2-0.4 us)
WORK_PER_CHAR = 16  # and steps for each character of the names (with one for each name's end)
MAX_BYTES = 32 << 20  # what a pass's caches may hold together
_PLAIN = re.compile(r"[A-Za-z0-9_.\-]+")


def check_pattern(text: str) -> int:
    """The states a target_modules or exclude_modules regex unfolds to (0 for one re matches alone); a
    ValueError saying why it cannot be matched here: not a regex, too long, or using what a set of states
    cannot follow (back references, atomic groups, flags)."""
    return _compile(text, text, Matching(()).budget, "it").states


def check_key(key: str) -> int:
    """check_pattern for a rank_pattern / alpha_pattern key, as PEFT's rule wraps it (0 for a plain one)."""
    if _PLAIN.fullmatch(key) and len(key) <= MAX_PATTERN:
        return 0
    return _compile(_peft(key), key, Matching(()).budget, "it").states


def fullmatch(pattern: str, name: str) -> bool:
    """re.fullmatch(pattern, name), in bounded time."""
    return Matching([name]).regex(pattern, "the pattern")(name)


def peft_match(key: str, name: str) -> bool:
    """Whether a rank_pattern / alpha_pattern key matches name by PEFT's rule."""
    return Matching([name]).keys([key], "the key").first(name) == 0


def _peft(key: str) -> str:
    return rf"(.*\.)?({key})$"


class Matching:
    """One pass of matching a config's patterns against the module names given: the automata it builds
    share one Budget, of BASE_WORK + WORK_PER_CHAR steps a character of the names and MAX_BYTES, and
    live as long as the pass does. A pattern past it raises ValueError naming it (its label) and what it
    cost; so every rank, matching the same names, reaches the same verdict."""

    def __init__(self, names: Iterable[str]) -> None:
        chars = sum(len(name) + 1 for name in names)
        self.budget = Budget(BASE_WORK + WORK_PER_CHAR * chars, MAX_BYTES)

    def regex(self, pattern: str, label: str) -> Callable[[str], bool]:
        """re.fullmatch(pattern, name) as a test of names."""
        compiled = _compile(pattern, pattern, self.budget, label)
        if isinstance(compiled, _Re):
            return compiled.fullmatch
        return lambda name: compiled.match(name, True)

    def keys(self, keys: Sequence[str], label: str) -> PatternKeys:
        """A config's rank_pattern or alpha_pattern keys (label names the field), matched in this pass."""
        return PatternKeys(keys, self, label)


class PatternKeys:
    """A config's rank_pattern or alpha_pattern keys, in its order: first(name) is the index of the first
    key PEFT would take for name, or None."""

    def __init__(self, keys: Sequence[str], matching: Matching, label: str) -> None:
        self.keys = list(keys)
        self._words: dict[str, int] = {}  # a key without dots -> its first index: it can only be the last word
        self._plain: dict[int, dict[tuple[int, ...], dict[str, int]]] = {}  # length -> dots -> key -> first index
        self._other: list[tuple[int, Callable[[str], bool]]] = []
        for i, key in enumerate(self.keys):
            if _PLAIN.fullmatch(key) and "." not in key:
                self._words.setdefault(key, i)
            elif _PLAIN.fullmatch(key):
                dots = tuple(j for j, ch in enumerate(key) if ch == ".")
                self._plain.setdefault(len(key), {}).setdefault(dots, {}).setdefault(key, i)
            else:
                nfa = _compile(_peft(key), key, matching.budget, f"{label} key {_short(key)}")
                self._other.append((i, nfa.match if isinstance(nfa, _Re) else lambda n, nfa=nfa: nfa.match(n, False)))

    def first(self, name: str) -> int | None:
        best = None
        if self._words:
            best = self._first_word(name)
        if self._plain:
            best = self._first_plain(name, best)
        for i, matches in self._other:
            if best is not None and i > best:
                break
            if matches(name):
                return i
        return best

    def _first_word(self, name: str) -> int | None:
        # (.*\.)?key$ for a key of one word: the name's last word, before a final newline $ also matches
        # at, and nothing but a dot-ended prefix the wrapping's .* can take (no newline) before it.
        head, _, word = name.removesuffix("\n").rpartition(".")
        return None if "\n" in head else self._words.get(word)

    def _first_plain(self, name: str, best: int | None) -> int | None:
        line = name.find("\n") % (len(name) + 1)  # the wrapping's .* stops at a newline
        starts = [0] + [j + 1 for j, ch in enumerate(name[:line]) if ch == "."]
        for start in starts:  # (.*\.)?key$: the key is a suffix that starts the name or follows a dot
            tail = name[start:]
            if tail.endswith("\n"):  # $ also matches before a final newline
                tail = tail[:-1]
            for dots, found in self._plain.get(len(tail), {}).items():
                if any(tail[j] == "\n" for j in dots):
                    continue
                masked = "".join("." if j in dots else ch for j, ch in enumerate(tail)) if dots else tail
                i = found.get(masked)
                if i is not None and (best is None or i < best):
                    best = i
        return best


class _Re:
    """A pattern re matches in one pass (it neither repeats, alternates nor looks around), its work
    counted a step a character."""

    def __init__(self, regex: re.Pattern[str], budget: Budget, label: str) -> None:
        self.regex, self.budget, self.label, self.states = regex, budget, label, 0

    def fullmatch(self, name: str) -> bool:
        self.budget.spend(len(name) + 1, self.label)
        return self.regex.fullmatch(name) is not None

    def match(self, name: str) -> bool:
        self.budget.spend(len(name) + 1, self.label)
        return self.regex.match(name) is not None


def _compile(pattern: str, own: str, budget: Budget, label: str) -> _Re | Nfa:
    """pattern as re compiles it where own (the part a config wrote: a key inside PEFT's wrapping) is a
    whole pattern that cannot backtrack, else as a set of states."""
    if len(own) > MAX_PATTERN:
        raise ValueError(f"a pattern of {len(own)} characters, over {MAX_PATTERN}")
    try:
        regex = re.compile(pattern)
        tree = sre_parse.parse(pattern)
        if tree.state.flags & ~(C.SRE_FLAG_UNICODE | C.SRE_FLAG_VERBOSE):
            raise ValueError("it sets flags, which are not matched here")
        if own == pattern and not _backtracks(tree):
            return _Re(regex, budget, label)
        return Nfa(tree, budget, label, MAX_STATES)
    except re.error as e:
        raise ValueError(f"not a valid pattern ({e})") from None
    except (RecursionError, OverflowError):
        raise ValueError("a pattern that nests too deeply") from None


def _backtracks(items) -> bool:
    """Whether re could try more than one way through items: anything but single characters, anchors and
    plain groups of them (a repeat, alternatives, and whatever else, such as an atomic group or a lookahead,
    which the states then match or refuse)."""
    for op, av in items:
        if op is C.SUBPATTERN:
            if _backtracks(av[3]):
                return True
        elif op not in (C.LITERAL, C.NOT_LITERAL, C.ANY, C.IN, C.AT):
            return True
    return False


def _short(text: str) -> str:
    return repr(text) if len(text) <= 60 else repr(text[:60]) + "..."
