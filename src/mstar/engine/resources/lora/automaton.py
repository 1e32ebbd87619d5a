"""A regex as a set of states, matched a character at a time in work and memory a Budget bounds.

Thompson's construction over re's own parse: ("char", test, next), ("split", a, b), ("assert", what,
next) and ("match",), stepped a character at a time from the set of states the name's prefix reaches,
each step and closure cached (a lazy DFA) under the Budget of the pass that built it. An assertion is
a question about one position of the name: where it is (^, $, \\b and the like), or whether a pattern
of its own matches from there on or ends there (a lookaround), asked once a position and answered by
the same machinery. So a name costs steps linear in its length times the states it visits, however re
would backtrack, and a Budget counts every state visited: a config whose patterns cost more than their
share is refused, never matched for minutes, and its caches never hold more than the Budget's bytes.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

try:
    from re import _constants as C
except ImportError:  # Python 3.10
    import sre_constants as C

CHAR, SPLIT, ASSERT, MATCH = range(4)
MAX_LOOK_DEPTH = 8  # lookarounds within lookarounds
_WORD = re.compile(r"\w")
# Where re answers \b and \B on an empty string its own way (\B matches nothing there before Python 3.14).
_EMPTY = {C.AT_BOUNDARY: re.search(r"\b", "") is not None, C.AT_NON_BOUNDARY: re.search(r"\B", "") is not None}
_CATEGORIES = {
    C.CATEGORY_DIGIT: re.compile(r"\d"), C.CATEGORY_NOT_DIGIT: re.compile(r"\D"),
    C.CATEGORY_SPACE: re.compile(r"\s"), C.CATEGORY_NOT_SPACE: re.compile(r"\S"),
    C.CATEGORY_WORD: re.compile(r"\w"), C.CATEGORY_NOT_WORD: re.compile(r"\W"),
}
_SET = 64  # bytes a cached set of states is counted for, and _PER_STATE for each state in it
_PER_STATE = 40
_ENTRY = 120  # bytes a cache entry is counted for
_ASK = 4  # steps an assertion's answer is counted for, beyond what a lookaround's own matching takes


class Budget:
    """What one pass of matching may spend: work (states visited and characters stepped, counted, so
    every rank reaches the same verdict on the same names) and bytes (what the caches of its automata
    hold together; past them every cache is let go, and matching goes on from empty caches)."""

    def __init__(self, work: int, nbytes: int) -> None:
        self.work, self.left, self.nbytes, self.held = work, work, nbytes, 0
        self.spent: dict[str, int] = {}  # label -> work
        self.caches: list[dict] = []
        self.looks: dict[tuple[_Look, int], bool] = {}  # a lookaround's answer at a position of self.name
        self.caches.append(self.looks)
        self.name: str | None = None

    def spend(self, units: int, label: str) -> None:
        self.left -= units
        self.spent[label] = self.spent.get(label, 0) + units
        if self.left < 0:
            raise OverBudget(self)

    def hold(self, nbytes: int) -> None:
        self.held += nbytes
        if self.held > self.nbytes:
            for cache in self.caches:
                cache.clear()
            self.held = nbytes

    def costliest(self) -> tuple[str, int]:
        """The label that spent the most, and what it spent."""
        return max(self.spent.items(), key=lambda kv: kv[1])


class OverBudget(ValueError):
    """Matching spent its Budget's work."""

    def __init__(self, budget: Budget) -> None:
        label, spent = budget.costliest()
        super().__init__(f"{label} costs more than the {budget.work:,} steps matching this config's patterns "
                         f"against its module names may take ({spent:,} of them spent on it when stopped)")


class Nfa:
    """The states of a parsed regex (what re's parser gives), matched under budget; label names it in a
    refusal. Raises ValueError for what a set of states cannot follow, and past max_states."""

    def __init__(self, tree, budget: Budget, label: str, max_states: int, _count: list[int] | None = None,
                 _depth: int = 0) -> None:
        self.budget, self.label, self.max_states, self.depth = budget, label, max_states, _depth
        self.count = _count if _count is not None else [0]  # states of this pattern with its lookarounds'
        self.kind: list[int] = [MATCH]
        self.arg: list = [None]
        self.next: list[int] = [0]
        self._classes: dict[int, tuple[_Class, object]] = {}  # one test per class of the tree, however repeated
        self.start = frozenset({self._build(list(tree), 0)})
        self.chars = [s for s, k in enumerate(self.kind) if k == CHAR]
        # the work of asking every char state about one character: a class's test costs its ranges and
        # categories, a literal or a class's literals one
        self.char_work = sum(getattr(self.arg[s], "cost", 1) for s in self.chars)
        del self._classes
        self._takes: dict[str, frozenset[int]] = {}  # a character -> the char states taking it
        self._steps: dict[tuple[frozenset[int], str], frozenset[int]] = {}  # before the closure
        self._moves: dict[tuple[frozenset[int], str], frozenset[int]] = {}  # and with it, where it asks nothing
        self._reach: dict[frozenset[int], tuple[int, ...]] = {}  # the assertions a set may reach
        self._closures: dict[tuple[frozenset[int], tuple[bool, ...]], frozenset[int]] = {}
        self._sets: dict[frozenset[int], frozenset[int]] = {}  # each set held once
        budget.caches += (self._takes, self._steps, self._moves, self._reach, self._closures, self._sets)

    @property
    def states(self) -> int:
        return self.count[0]

    def match(self, name: str, full: bool) -> bool:
        """re.fullmatch (full) or re.match of the pattern on name."""
        budget = self.budget
        if budget.name != name:  # the answers of lookarounds are the last name's
            budget.held -= _ENTRY * len(budget.looks)
            budget.looks.clear()
            budget.name = name
        return self.run(name, 0, len(name), not full)

    def run(self, name: str, pos: int, stop: int, prefix: bool) -> bool:
        """Whether the pattern matches name from pos: anywhere up to stop (prefix), or ending at stop."""
        cur = self._closure(self.start, name, pos)
        moves, begun = self._moves, pos
        while not (prefix and 0 in cur) and pos < stop and cur:
            ch = name[pos]
            pos += 1
            after = moves.get((cur, ch))  # where no assertion is reached, the step and its closure at once
            if after is None:
                after = self._move(cur, ch, name, pos)
            cur = after
        self.budget.spend(pos - begun + 1, self.label)
        return 0 in cur

    def _move(self, cur: frozenset[int], ch: str, name: str, pos: int) -> frozenset[int]:
        after = self._steps.get((cur, ch))
        if after is None:
            after = self._step(cur, ch)
        closed = self._closure(after, name, pos)
        if self._reach.get(after) == ():  # (None where a flush let go of it since)
            self.budget.hold(_ENTRY)
            self._moves[(self._keep(cur), ch)] = closed
        return closed

    def _keep(self, states: frozenset[int]) -> frozenset[int]:
        kept = self._sets.get(states)
        if kept is None:
            self.budget.hold(_SET + _PER_STATE * len(states) + _ENTRY)
            kept = self._sets[states] = states
        return kept

    def _step(self, cur: frozenset[int], ch: str) -> frozenset[int]:
        takes = self._takes.get(ch)
        if takes is None:
            self.budget.spend(self.char_work, self.label)
            takes = frozenset(s for s in self.chars if self.arg[s](ch))
            self.budget.hold(_SET + _PER_STATE * len(takes) + _ENTRY)
            self._takes[ch] = takes
        self.budget.spend(len(cur), self.label)
        after = self._keep(frozenset(self.next[s] for s in cur if s in takes))
        self.budget.hold(_ENTRY)
        self._steps[(self._keep(cur), ch)] = after
        return after

    def _closure(self, states: frozenset[int], name: str, pos: int) -> frozenset[int]:
        # What follows from states at pos, through splits and the assertions that hold there: the set
        # and the answers of the assertions it may reach decide it, so it is cached by them.
        reach = self._reach.get(states)
        if reach is None:
            reach = tuple(sorted(s for s in self._walk(states, None) if self.kind[s] == ASSERT))
            self.budget.hold(_ENTRY + 8 * len(reach))
            self._reach[self._keep(states)] = reach
        answers = ()
        if reach:  # each answer a few lookups at least: counted as _ASK steps
            self.budget.spend(_ASK * len(reach), self.label)
            answers = tuple([self._holds(s, name, pos) for s in reach])
        found = self._closures.get((states, answers))
        if found is None:
            holds = dict(zip(reach, answers, strict=True))
            found = self._keep(frozenset(s for s in self._walk(states, holds) if self.kind[s] in (CHAR, MATCH)))
            self.budget.hold(_ENTRY + 8 * len(answers))
            self._closures[(self._keep(states), answers)] = found
        return found

    def _walk(self, states: frozenset[int], holds: dict[int, bool] | None) -> set[int]:
        """The states reached from states through splits and the assertions that hold (all, if None)."""
        seen, todo = set(), list(states)
        kind, arg, nxt = self.kind, self.arg, self.next
        while todo:
            s = todo.pop()
            if s in seen:
                continue
            seen.add(s)
            if kind[s] == SPLIT:
                todo += (arg[s], nxt[s])
            elif kind[s] == ASSERT and (holds is None or holds[s]):
                todo.append(nxt[s])
        self.budget.spend(len(seen), self.label)
        return seen

    def _holds(self, s: int, name: str, pos: int) -> bool:
        what = self.arg[s]
        if not isinstance(what, _Look):
            return what(name, pos)
        if what.by_text:  # answered by its text's own cache
            return what.holds(name, pos)
        looks = self.budget.looks
        answer = looks.get((what, pos))
        if answer is None:
            answer = what.holds(name, pos)
            self.budget.hold(_ENTRY)
            looks[(what, pos)] = answer
        return answer

    def _add(self, kind: int, arg, then: int) -> int:
        if self.count[0] >= self.max_states:
            raise ValueError(f"a pattern that unfolds to more than {self.max_states} states")
        self.count[0] += 1
        self.kind.append(kind)
        self.arg.append(arg)
        self.next.append(then)
        return len(self.kind) - 1

    def _build(self, items: list, then: int) -> int:
        for op, av in reversed(items):
            then = self._item(op, av, then)
        return then

    def _item(self, op, av, then: int) -> int:
        if op is C.LITERAL:
            return self._add(CHAR, functools.partial(str.__eq__, chr(av)), then)
        if op is C.NOT_LITERAL:
            return self._add(CHAR, functools.partial(str.__ne__, chr(av)), then)
        if op is C.ANY:
            return self._add(CHAR, functools.partial(str.__ne__, "\n"), then)
        if op is C.IN:
            known = self._classes.get(id(av))  # a repeat's copies are one class of the parsed tree
            if known is None:
                known = self._classes[id(av)] = (_Class(av), av)  # av held, so its id stays its own
            return self._add(CHAR, known[0], then)
        if op is C.SUBPATTERN:
            if av[1] or av[2]:
                raise ValueError("a group that sets flags is not matched here")
            return self._build(list(av[3]), then)
        if op is C.BRANCH:
            starts = [self._build(list(alt), then) for alt in av[1]]
            first = starts[-1]
            for s in reversed(starts[:-1]):
                first = self._add(SPLIT, s, first)
            return first
        if op in (C.MAX_REPEAT, C.MIN_REPEAT):  # lazy or greedy, the names they match are the same
            return self._repeat(*av, then)
        if op is C.AT and av in _AT:
            return self._add(ASSERT, _at(av), then)
        if op in (C.ASSERT, C.ASSERT_NOT):
            return self._add(ASSERT, self._look(op is C.ASSERT_NOT, *av), then)
        raise ValueError(f"a pattern using {str(av if op is C.AT else op).lower()} is not matched here")

    def _repeat(self, low: int, high: int, sub, then: int) -> int:
        out = then
        if high is C.MAXREPEAT:
            loop = self._add(SPLIT, None, then)
            self.arg[loop] = self._build(list(sub), loop)
            out = loop
        else:
            for _ in range(high - low):
                out = self._add(SPLIT, self._build(list(sub), out), then)
        for _ in range(low):
            before = self.count[0]
            out = self._build(list(sub), out)
            if self.count[0] == before:  # sub unfolds to no states ((?:), a{0}): nor will its other copies,
                break  # so (?:){4294967294} costs one pass over sub, not four billion
        return out

    def _look(self, negate: bool, direction: int, sub) -> _Look:
        if self.depth >= MAX_LOOK_DEPTH:
            raise ValueError(f"lookarounds nested more than {MAX_LOOK_DEPTH} deep are not matched here")
        nfa = Nfa(sub, self.budget, self.label, self.max_states, self.count, self.depth + 1)
        return _Look(nfa, direction > 0, negate, sub.getwidth()[0])  # re refuses a lookbehind of varying width


class _Look:
    """(?=...), (?!...), (?<=...) or (?<!...): whether nfa matches from a position on (ahead), or in the
    width characters that end there (behind), the answer negated for (?!...) and (?<!...)."""

    def __init__(self, nfa: Nfa, ahead: bool, negate: bool, width: int) -> None:
        self.nfa, self.ahead, self.negate, self.width = nfa, ahead, negate, width
        # A lookbehind that asserts nothing itself answers by its width's characters alone, whatever the name.
        self.by_text = not ahead and ASSERT not in nfa.kind
        self._answers: dict[str, bool] = {}
        nfa.budget.caches.append(self._answers)

    def holds(self, name: str, pos: int) -> bool:
        if self.ahead:
            found = self.nfa.run(name, pos, len(name), True)
        elif pos < self.width:
            found = False
        elif self.by_text:
            text = name[pos - self.width : pos]
            found = self._answers.get(text)
            if found is None:
                found = self.nfa.run(name, pos - self.width, pos, False)
                self.nfa.budget.hold(_ENTRY + self.width)
                self._answers[text] = found
        else:
            found = self.nfa.run(name, pos - self.width, pos, False)
        return found != self.negate


class _Class:
    """A character class's test: its literals one set, its ranges and categories tried in turn; cost is
    what one question of it is counted in a Budget."""

    def __init__(self, items) -> None:
        self.negate = bool(items) and items[0][0] is C.NEGATE
        literals, self.ranges, self.categories = set(), [], []
        for op, av in items[1:] if self.negate else items:
            if op is C.LITERAL:
                literals.add(chr(av))
            elif op is C.RANGE:
                self.ranges.append(tuple(av))
            elif op is C.CATEGORY and av in _CATEGORIES:
                self.categories.append(_CATEGORIES[av])
            else:
                raise ValueError(f"a character class using {str(op).lower()} is not matched here")
        self.literals = frozenset(literals)
        self.cost = 1 + len(self.ranges) + len(self.categories)

    def __call__(self, ch: str) -> bool:
        found = ch in self.literals or any(lo <= ord(ch) <= hi for lo, hi in self.ranges) \
            or any(r.match(ch) is not None for r in self.categories)
        return found != self.negate


def _word(name: str, pos: int) -> bool:
    return 0 <= pos < len(name) and _WORD.match(name[pos]) is not None


def _boundary(name: str, pos: int) -> bool:
    return _EMPTY[C.AT_BOUNDARY] if not name else _word(name, pos - 1) != _word(name, pos)


def _non_boundary(name: str, pos: int) -> bool:
    return _EMPTY[C.AT_NON_BOUNDARY] if not name else _word(name, pos - 1) == _word(name, pos)


_AT: dict = {
    C.AT_BEGINNING: lambda name, pos: pos == 0,
    C.AT_BEGINNING_STRING: lambda name, pos: pos == 0,
    C.AT_END: lambda name, pos: pos == len(name) or (pos == len(name) - 1 and name[-1] == "\n"),
    C.AT_END_STRING: lambda name, pos: pos == len(name),
    C.AT_BOUNDARY: _boundary,
    C.AT_NON_BOUNDARY: _non_boundary,
}


def _at(where) -> Callable[[str, int], bool]:
    return _AT[where]
