"""PEFT's module-name patterns, matched with PEFT's rule in time bounded by the name and the pattern.

rank_pattern and alpha_pattern keys are regexes PEFT tries in order, `re.match(rf"(.*\\.)?({key})$",
name)`, the first that matches winning; target_modules and exclude_modules given as one string are
`re.fullmatch`ed. Python's re backtracks, so a key like `(.|.)*#` takes 2^31 steps on one module name:
a config is a file anyone may hand the startup check, and alternatives alone backtrack as badly
(`(\\w|[^#]|.)` two dozen times, then `#`). So a pattern that repeats or alternates is matched as a set
of states (Thompson's construction over re's own parse), stepped a character at a time with the step
cached per set of states (a lazy DFA), which answers the same question in steps linear in the name;
one with neither is left to re, which cannot blow up on it. A config's patterns together may unfold
to at most MAX_CONFIG_STATES states, which bounds what its matching can cost.
Keys made of names alone (letters, digits, _ and -, dots matching any character as in PEFT) are
found through an index, so a pattern per module (a rank_pattern AdaLoRA wrote) costs a few lookups
per module rather than one match per key.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence

try:
    from re import _constants as C
    from re import _parser as sre_parse
except ImportError:  # Python 3.10
    import sre_constants as C
    import sre_parse

MAX_PATTERN = 1024  # characters in one pattern
MAX_STATES = 4096  # states a pattern may unfold to (x{64}{64} unfolds to 4,096)
MAX_CONFIG_STATES = 16_384  # states all of one config's patterns may unfold to
_PLAIN = re.compile(r"[A-Za-z0-9_.\-]+")
_WORD = re.compile(r"\w")
_CATEGORIES = {
    C.CATEGORY_DIGIT: re.compile(r"\d"), C.CATEGORY_NOT_DIGIT: re.compile(r"\D"),
    C.CATEGORY_SPACE: re.compile(r"\s"), C.CATEGORY_NOT_SPACE: re.compile(r"\S"),
    C.CATEGORY_WORD: re.compile(r"\w"), C.CATEGORY_NOT_WORD: re.compile(r"\W"),
}


def check_pattern(text: str) -> int:
    """The states a target_modules or exclude_modules regex unfolds to (0 for one re matches alone); a
    ValueError saying why it cannot be matched here: not a regex, too long, or using what a set of states
    cannot follow (back references, lookarounds)."""
    return _states(text, text)


def check_key(key: str) -> int:
    """check_pattern for a rank_pattern / alpha_pattern key, as PEFT's rule wraps it."""
    return _states(_peft(key), key)


def _states(pattern: str, own: str) -> int:
    if len(own) > MAX_PATTERN:
        raise ValueError(f"a pattern of {len(own)} characters, over {MAX_PATTERN}")
    nfa = _compiled(pattern, own)[1]
    return 0 if nfa is None else len(nfa.states)


def fullmatch(pattern: str, name: str) -> bool:
    """re.fullmatch(pattern, name), in bounded time."""
    return _matches(pattern, pattern, name, True)


def peft_match(key: str, name: str) -> bool:
    """Whether a rank_pattern / alpha_pattern key matches name by PEFT's rule."""
    return _matches(_peft(key), key, name, False)


def _peft(key: str) -> str:
    return rf"(.*\.)?({key})$"


class PatternKeys:
    """A config's rank_pattern or alpha_pattern keys, in its order: first(name) is the index of the first
    key PEFT would take for name, or None."""

    def __init__(self, keys: Sequence[str]) -> None:
        self.keys = list(keys)
        self._found: dict[str, int | None] = {}  # a model's modules are asked for again and again
        self._words: dict[str, int] = {}  # a key without dots -> its first index: it can only be the last word
        self._plain: dict[int, dict[tuple[int, ...], dict[str, int]]] = {}  # length -> dots -> key -> first index
        self._other: list[int] = []
        for i, key in enumerate(self.keys):
            if _PLAIN.fullmatch(key) and "." not in key:
                self._words.setdefault(key, i)
            elif _PLAIN.fullmatch(key):
                dots = tuple(j for j, ch in enumerate(key) if ch == ".")
                self._plain.setdefault(len(key), {}).setdefault(dots, {}).setdefault(key, i)
            else:
                self._other.append(i)

    def first(self, name: str) -> int | None:
        if name not in self._found:
            if len(self._found) > 1 << 17:
                self._found.clear()
            self._found[name] = self._first(name)
        return self._found[name]

    def _first(self, name: str) -> int | None:
        best = None
        if self._words and "\n" not in name:
            best = self._words.get(name.rpartition(".")[2])
        if self._plain:
            best = self._first_plain(name, best)
        for i in self._other:
            if best is not None and i > best:
                break
            if peft_match(self.keys[i], name):
                return i
        return best

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


@functools.lru_cache(maxsize=1 << 16)
def _matches(pattern: str, own: str, name: str, full: bool) -> bool:
    regex, nfa = _compiled(pattern, own)
    if nfa is None:
        return bool((regex.fullmatch if full else regex.match)(name))
    return nfa.match(name, full)


@functools.lru_cache(maxsize=256)  # at most MAX_STATES states each
def _compiled(pattern: str, own: str) -> tuple[re.Pattern[str], _Nfa | None]:
    """pattern as re compiles it, and as a set of states where own (the part a config wrote: a key inside
    PEFT's wrapping, which repeats only what cannot blow up) repeats or alternates."""
    try:
        regex = re.compile(pattern)
        tree = sre_parse.parse(pattern)
        if tree.state.flags & ~(C.SRE_FLAG_UNICODE | C.SRE_FLAG_VERBOSE):
            raise ValueError("it sets flags, which are not matched here")
        try:
            plain = own != pattern and not _backtracks(sre_parse.parse(own))
        except re.error:  # a key that is no regex alone (an unbalanced group) is matched as wrapped
            plain = False
        return regex, (None if plain or not _backtracks(tree) else _Nfa(tree))
    except re.error as e:
        raise ValueError(f"not a valid pattern ({e})") from None
    except (RecursionError, OverflowError):
        raise ValueError("a pattern that nests too deeply") from None


def _backtracks(items) -> bool:
    """Whether re could try more than one way through items: anything but single characters, anchors and
    plain groups of them (a repeat, alternatives, and whatever else, such as an atomic group or a lookahead,
    which the states then refuse to match)."""
    for op, av in items:
        if op is C.SUBPATTERN:
            if _backtracks(av[3]):
                return True
        elif op not in (C.LITERAL, C.NOT_LITERAL, C.ANY, C.IN, C.AT):
            return True
    return False


class _Nfa:
    """A regex as states: ("char", test, next), ("split", a, b), ("at", where, next) and ("match",)."""

    def __init__(self, tree) -> None:
        self.states: list[list] = [["match"]]
        self.start = self._build(list(tree), 0)
        self._steps: dict[tuple[frozenset[int], str], frozenset[int]] = {}
        self._closures: dict[tuple[frozenset[int], tuple], frozenset[int]] = {}

    def _add(self, *state) -> int:
        if len(self.states) >= MAX_STATES:
            raise ValueError(f"a pattern that unfolds to more than {MAX_STATES} states")
        self.states.append(list(state))
        return len(self.states) - 1

    def _build(self, items: list, then: int) -> int:
        for op, av in reversed(items):
            then = self._item(op, av, then)
        return then

    def _item(self, op, av, then: int) -> int:
        if op is C.LITERAL:
            return self._add("char", functools.partial(str.__eq__, chr(av)), then)
        if op is C.NOT_LITERAL:
            return self._add("char", functools.partial(str.__ne__, chr(av)), then)
        if op is C.ANY:
            return self._add("char", functools.partial(str.__ne__, "\n"), then)
        if op is C.IN:
            return self._add("char", _in(av), then)
        if op is C.SUBPATTERN:
            if av[1] or av[2]:
                raise ValueError("a group that sets flags is not matched here")
            return self._build(list(av[3]), then)
        if op is C.BRANCH:
            starts = [self._build(list(alt), then) for alt in av[1]]
            first = starts[-1]
            for s in reversed(starts[:-1]):
                first = self._add("split", s, first)
            return first
        if op in (C.MAX_REPEAT, C.MIN_REPEAT):  # lazy or greedy, the names they match are the same
            low, high, sub = av
            out = then
            if high is C.MAXREPEAT:
                loop = self._add("split", None, then)
                self.states[loop][1] = self._build(list(sub), loop)
                out = loop
            else:
                for _ in range(high - low):
                    out = self._add("split", self._build(list(sub), out), then)
            for _ in range(low):
                out = self._build(list(sub), out)
            return out
        if op is C.AT and av in _AT:
            return self._add("at", _AT[av], then)
        raise ValueError(f"a pattern using {str(av if op is C.AT else op).lower()} is not matched here")

    def match(self, name: str, full: bool) -> bool:
        current = self._closure(frozenset({self.start}), name, 0)
        for pos, ch in enumerate(name):
            if not full and 0 in current:
                return True
            key = (current, ch)
            step = self._steps.get(key)
            if step is None:
                states = self.states
                step = frozenset(states[s][2] for s in current if states[s][0] == "char" and states[s][1](ch))
                if len(self._steps) > 1 << 16:
                    self._steps.clear()
                self._steps[key] = step
            if not step:
                return False
            current = self._closure(step, name, pos + 1)
        return 0 in current

    def _closure(self, start: frozenset[int], name: str, pos: int) -> frozenset[int]:
        # What the assertions see: the start, the end (or before a final newline), and whether the
        # characters either side are word characters. The closure follows from these and the set alone.
        where = (pos == 0, pos == len(name), pos == len(name) - 1 and name[-1:] == "\n",
                 _word(name, pos - 1), _word(name, pos))
        key = (start, where)
        found = self._closures.get(key)
        if found is None:
            found = frozenset(self._close(start, name, pos))
            if len(self._closures) > 1 << 16:
                self._closures.clear()
            self._closures[key] = found
        return found

    def _close(self, start: frozenset[int], name: str, pos: int) -> set[int]:
        seen, todo = set(), list(start)
        while todo:
            s = todo.pop()
            if s in seen:
                continue
            seen.add(s)
            state = self.states[s]
            if state[0] == "split":
                todo += (state[1], state[2])
            elif state[0] == "at" and state[1](name, pos):
                todo.append(state[2])
        return seen


def _in(items) -> Callable[[str], bool]:
    negate = bool(items) and items[0][0] is C.NEGATE
    tests = []
    for op, av in items[1:] if negate else items:
        if op is C.LITERAL:
            tests.append(functools.partial(str.__eq__, chr(av)))
        elif op is C.RANGE:
            lo, hi = av
            tests.append(lambda ch, lo=lo, hi=hi: lo <= ord(ch) <= hi)
        elif op is C.CATEGORY and av in _CATEGORIES:
            tests.append(lambda ch, r=_CATEGORIES[av]: r.match(ch) is not None)
        else:
            raise ValueError(f"a character class using {str(op).lower()} is not matched here")
    return lambda ch: any(t(ch) for t in tests) != negate


def _word(name: str, pos: int) -> bool:
    return 0 <= pos < len(name) and _WORD.match(name[pos]) is not None


_AT: dict = {
    C.AT_BEGINNING: lambda name, pos: pos == 0,
    C.AT_BEGINNING_STRING: lambda name, pos: pos == 0,
    C.AT_END: lambda name, pos: pos == len(name) or (pos == len(name) - 1 and name[-1] == "\n"),
    C.AT_END_STRING: lambda name, pos: pos == len(name),
    C.AT_BOUNDARY: lambda name, pos: _word(name, pos - 1) != _word(name, pos),
    C.AT_NON_BOUNDARY: lambda name, pos: _word(name, pos - 1) == _word(name, pos),
}
