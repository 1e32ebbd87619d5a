"""A mutation run over the modules that decide served weights: each mutant in scripts/mutants.py (a small
change a real bug could look like) applied alone to a temporary copy of the tree, and the test files that
should notice it run against that copy. A mutant the tests pass is a survivor: it needs a test, or a line
in mutants.py saying why it serves what the original does.

    .venv/bin/python scripts/mutate.py --list              # every mutant, and whether its anchor still matches
    .venv/bin/python scripts/mutate.py --run               # all of them (about twenty minutes on two cores)
    .venv/bin/python scripts/mutate.py --run pool digest   # those of some modules, or by id
    .venv/bin/python scripts/mutate.py --run --tests-from main   # against another revision's tests/

Run by hand, not in CI. A mutant whose anchor no longer matches exactly once (its code was rewritten) is
reported stale and counts neither way: give it a new anchor for the same bug.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from mutants import MUTANTS, PACKAGE, TESTS, Mutant

ROOT = Path(__file__).resolve().parents[1]


def mutated(m: Mutant, source: str) -> str | None:
    """source with m applied, or None where its anchor does not match exactly once."""
    pattern = m.find if m.regex else re.escape(m.find)
    if len(re.findall(pattern, source, re.M)) != 1:
        return None
    new = re.sub(pattern, m.replace if m.regex else m.replace.replace("\\", "\\\\"), source, count=1, flags=re.M)
    return new if new != source else None


def tests_of(m: Mutant, tree: Path) -> list[str]:
    """m's test files that tree has (an older revision's tests/ may lack some)."""
    return [t for t in dict.fromkeys((*TESTS[m.module], *m.tests)) if (tree / t).is_file()]


def missing_tests(chosen: list[Mutant]) -> list[str]:
    """Test files the mutants name that this tree lacks: a renamed file would silently test nothing."""
    return sorted({t for m in chosen for t in (*TESTS[m.module], *m.tests) if not (ROOT / t).is_file()})


def copy_tree(dest: Path, tests_from: str | None) -> None:
    """The tree as git sees it (tracked and untracked files, not the ignored), tests/ from a revision if asked."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file() and not (tests_from and f.startswith("tests/")):
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)
    if tests_from:
        archive = subprocess.run(["git", "archive", tests_from, "tests"], cwd=ROOT, check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)


def environment(tree: Path) -> dict[str, str]:
    # The copy's src first on the path, ahead of the editable install's; no bytecode, which a mutant and
    # its restored original written in one second could share.
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "src"), os.environ.get("PYTHONPATH", "")]),
            "PYTHONDONTWRITEBYTECODE": "1"}


def pytest(tree: Path, tests: list[str], timeout: float) -> tuple[str, str, float]:
    """(outcome, first failing test, seconds) of the tests run in tree: passed, failed or timeout."""
    start = time.perf_counter()
    try:
        run = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:warnings", *tests], cwd=tree,
                             env=environment(tree), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", "", time.perf_counter() - start
    seconds = time.perf_counter() - start
    if run.returncode == 0:
        return "passed", "", seconds
    lines = run.stdout.splitlines()
    first = next((ln.split(" ", 1)[1] for ln in lines if ln.startswith(("FAILED ", "ERROR "))),
                 lines[-1] if lines else f"exit {run.returncode}")
    return "failed", first[:150], seconds


def check_import(tree: Path) -> None:
    where = subprocess.run([sys.executable, "-c", f"import {PACKAGE} as m; print(m.__file__)"], cwd=tree,
                           env=environment(tree), capture_output=True, text=True, check=True).stdout.strip()
    if not where.startswith(str(tree)):
        raise SystemExit(f"the copy imports {PACKAGE} from {where}, not from itself")


def select(names: list[str]) -> list[Mutant]:
    if not names:
        return list(MUTANTS)
    chosen = [m for m in MUTANTS if m.id in names or m.module.removesuffix(".py") in names]
    unknown = set(names) - {m.id for m in chosen} - {m.module.removesuffix(".py") for m in chosen}
    if unknown:
        raise SystemExit(f"no mutant or module {sorted(unknown)}")
    return chosen


def source_of(m: Mutant, tree: Path = ROOT) -> Path:
    return tree / "src" / PACKAGE.replace(".", "/") / m.module


def list_mutants(chosen: list[Mutant]) -> None:
    for m in chosen:
        new = mutated(m, source_of(m).read_text())
        state = "STALE" if new is None else "ok"
        try:
            compile(new or "", m.module, "exec")
        except SyntaxError:
            state = "BROKEN"
        note = f"  [equivalent: {m.equivalent}]" if m.equivalent else ""
        print(f"{state:5} {m.id:42} {m.bug}{note}")
    print(f"{len(chosen)} mutants")
    for t in missing_tests(chosen):
        print(f"MISSING test file {t}")


def run(chosen: list[Mutant], tests_from: str | None, timeout: float | None) -> int:
    if not tests_from and missing_tests(chosen):
        raise SystemExit(f"the mutants name test files this tree lacks: {', '.join(missing_tests(chosen))}")
    with tempfile.TemporaryDirectory(prefix="mstar-mutate-") as tmp:
        tree = Path(tmp)
        copy_tree(tree, tests_from)
        check_import(tree)
        suites = sorted({t for m in chosen for t in tests_of(m, tree)})
        outcome, first, base = pytest(tree, suites, 3600)
        if outcome != "passed":
            raise SystemExit(f"the unmutated tree fails its tests ({first}): fix that first")
        print(f"baseline: {len(suites)} test files pass unmutated in {base:.0f} s", flush=True)
        results = {}
        for m in chosen:
            path = source_of(m, tree)
            original = path.read_text()
            new = mutated(m, original)
            if new is None:
                results[m.id] = "stale"
                print(f"STALE    {m.id}: its anchor no longer matches once in {m.module}", flush=True)
                continue
            path.write_text(new)
            try:
                outcome, first, seconds = pytest(tree, tests_of(m, tree), timeout or max(120.0, 3 * base))
            finally:
                path.write_text(original)
            verdict = "survived" if outcome == "passed" else "killed"
            results[m.id] = verdict
            why = first if verdict == "killed" else (f"equivalent: {m.equivalent}" if m.equivalent else m.bug)
            print(f"{verdict.upper():8} {m.id:42} {seconds:5.0f} s  {outcome if outcome == 'timeout' else why}",
                  flush=True)
    return report(chosen, results)


def report(chosen: list[Mutant], results: dict[str, str]) -> int:
    ran = [m for m in chosen if results[m.id] != "stale"]
    killed = [m for m in ran if results[m.id] == "killed"]
    survivors = [m for m in ran if results[m.id] == "survived"]
    unexplained = [m for m in survivors if not m.equivalent]
    stale = len(chosen) - len(ran)
    print(f"\nscore: {len(killed)} killed / {len(ran)} run ({len(survivors)} survived, "
          f"{len(survivors) - len(unexplained)} of them equivalent; {stale} stale)")
    for m in survivors:
        print(f"  survivor {m.id}: " + (f"equivalent: {m.equivalent}" if m.equivalent else f"NEEDS A TEST: {m.bug}"))
    for m in killed:
        if m.equivalent:
            print(f"  {m.id} is marked equivalent but was killed: drop the mark")
    return 1 if unexplained or stale else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutant ids or module names (spec, reader, ...); default all")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--list", action="store_true", help="list the mutants without running anything")
    mode.add_argument("--run", action="store_true", help="run each mutant against its test files")
    parser.add_argument("--tests-from", metavar="REV", help="take tests/ from this git revision")
    parser.add_argument("--timeout", type=float, help="seconds per mutant (default 3x the baseline, at least 120)")
    args = parser.parse_args()
    # Stopped, it still restores the mutated file, ends the test run under way and removes its copy.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    chosen = select(args.names)
    if args.list:
        list_mutants(chosen)
        return 0
    return run(chosen, args.tests_from, args.timeout)


if __name__ == "__main__":
    raise SystemExit(main())
