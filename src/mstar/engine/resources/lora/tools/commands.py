"""What `mstar-lora inspect` and `check` report: one row per adapter, as a table or as JSON.

A row's fields are those of the README's command-line section: adapter, path, verdict ("ok" or
"refused"), reason (the refusal, as the library raises it; null when ok), rank, scaling, targets,
file_bytes; check adds digest (whole, as check_adapter_file returns it), host_bytes and, for a mixture of
experts, expert_bytes; inspect adds modules for one adapter or with --modules.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..check import (
    adapter_problems,
    check_checkpoint,
    inspect_checkpoint,
    module_rank,
    module_reasons,
    unservable,
)
from ..checkpoint import Checkpoint, default_name, open_checkpoint, refusal
from ..json_file import read_json
from ..layout import SlotLayout
from ..models import specs_from_config
from ..plan import host_bytes
from ..spec import LoraSpec
from .cli import UsageError
from .table import size, table
from .targets import COLUMNS, target_cells, target_rows

Row = dict[str, Any]


def model_specs(args: argparse.Namespace) -> dict[str, LoraSpec]:
    try:
        return specs_from_config(args.model, max_rank=args.max_rank, max_expert_rank=args.max_expert_rank)
    except ValueError as e:
        raise UsageError(str(e)) from None


def adapter_argument(arg: str) -> tuple[str, str]:
    """(name, path) of an ADAPTER argument: NAME=PATH, or a path named after itself. A path that exists
    is a path whatever it holds (a training sweep writes lr=1e-4/), and a NAME has no /."""
    name, sep, path = arg.partition("=")
    if not sep or os.path.lexists(arg) or "/" in name or os.sep in name:
        return _default_name(arg), arg
    if not name or not path:
        raise UsageError(f"{arg!r}: NAME=PATH needs both a name and a path")
    return name, path


def _default_name(path: str) -> str:
    try:
        name = default_name(path)
        return name if name not in ("", ".", "..") else default_name(Path(path).resolve())
    except OSError:  # a name too long to stat: open_checkpoint says so
        return Path(path).name


def named_adapters(args: Sequence[str], serving: str | None = None) -> dict[str, str]:
    """Every adapter the command names, by name; two of one name are refused, as one would go unchecked."""
    given = [(*adapter_argument(a), "the command line") for a in args]
    if serving:
        given += [(n, p, serving) for n, p in serving_config(serving).items()]
    out: dict[str, str] = {}
    origin: dict[str, str] = {}
    for name, path, where in given:
        if name in out:
            first = out[name] if origin[name] == where else f"{out[name]} from {origin[name]}"
            raise UsageError(f"two adapters are named {name!r}: {first} and {path} from {where}; name them apart "
                             "(NAME=PATH)")
        out[name], origin[name] = path, where
    return out


def serving_config(path: str) -> dict[str, str]:
    """The adapters a serving config names: a JSON object of name -> path, or one whose "adapters" is."""
    try:
        raw = read_json(path, object_pairs_hook=_unique_keys)
    except ValueError as e:
        raise UsageError(f"serving config {path}: {e}") from None
    adapters = raw.get("adapters", raw) if isinstance(raw, dict) else raw
    if not isinstance(adapters, dict) or not all(isinstance(v, str) and v for v in adapters.values()):
        what = "an object with values that are not paths" if isinstance(adapters, dict) else \
            f"a JSON {type(adapters).__name__}"
        raise UsageError(f'serving config {path}: needs an object of adapter name -> path (or one under '
                         f'"adapters"), not {what}')
    if "" in adapters:
        raise UsageError(f"serving config {path}: an adapter's name is empty")
    return adapters


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:  # JSON would keep the last silently, and the first would go unchecked
            raise ValueError(f"{key!r} appears twice")
        seen.add(key)
    return dict(pairs)


def adapter_row(specs: dict[str, LoraSpec], name: str, path: str) -> tuple[Row, Checkpoint | None]:
    """One adapter's row from its header alone, its verdict included, and the checkpoint opened (None if
    it could not be), its file open for the caller to read and close."""
    row: Row = {"adapter": name, "path": path, "verdict": "refused", "reason": None, "rank": None,
                "scaling": None, "targets": [], "file_bytes": None}
    try:
        ckpt = open_checkpoint(path, name)
    except (ValueError, OSError) as e:  # an OSError too is this adapter's, never the gate's crash
        why = str(e) if isinstance(e, ValueError) else str(refusal(name, path, [e.strerror or str(e)]))
        return {**row, "reason": why, "reasons": [why]}, None
    row["file_bytes"] = ckpt.size
    nodes = list(specs.values())
    try:  # what cannot be inspected (an alpha that is not a number, say) is a reason like any other
        infos = [inspect_checkpoint(spec, ckpt) for spec in nodes]
        row["rank"] = max(i.rank for i in infos) or None  # None: no module has a lora_A (LoHa, say)
        row["scaling"] = ckpt.scaling(nodes[0].convert_keys)
        problems = adapter_problems(nodes, ckpt)
    except ValueError as e:
        ckpt.close()
        return {**row, "reason": str(e), "reasons": [str(e)]}, None
    touched = [{spec.locate(m).target for m in problems if spec.locate(m)} | i.targets
               for spec, i in zip(nodes, infos, strict=True)]
    row["targets"] = [t for ts in touched for t in sorted(ts)]
    reasons = module_reasons(problems) if ckpt.header.tensors else ["it holds no weights"]
    if reasons:
        return {**row, "reason": str(ckpt.refusal(reasons)), "reasons": reasons}, ckpt
    return {**row, "verdict": "ok", "reasons": []}, ckpt


def module_rows(specs: dict[str, LoraSpec], ckpt: Checkpoint) -> list[Row]:
    """Each module of the checkpoint as the nodes read it: target, layer, slice (an index, a list, or None
    for every slice), rank and scaling; expert modules one row per target and layer, not thousands, with
    the experts found and their ranks and scalings."""
    rows, experts = [], {}
    for node, spec in specs.items():
        scalings = ckpt.scalings(spec.convert_keys)
        for module, keys in sorted(ckpt.modules(spec.convert_keys).items()):
            loc = spec.locate(module)
            if loc is None and len(specs) > 1:
                continue
            a = keys.roles.get("A")
            rank = module_rank(spec, loc, a.shape) if a is not None and a.shape else None
            t = spec.targets[loc.target] if loc else None
            if t is not None and t.experts is not None:
                per = t.slices // t.experts.count
                row = experts.setdefault((node, loc.target, loc.layer), {
                    "module": re.sub(r"\.experts\..*", ".experts.*", module), "node": node, "target": loc.target,
                    "layer": loc.layer, "experts": set(), "ranks": set(), "scalings": set()})
                row["experts"].update(range(t.experts.count) if loc.slice is None else [loc.slice // per])
                row["ranks"].add(rank)
                row["scalings"].add(scalings[module])
                continue
            where = {"target": None, "layer": None, "slice": None} if loc is None else \
                {"target": loc.target, "layer": loc.layer,
                 "slice": list(loc.slice) if isinstance(loc.slice, tuple) else loc.slice}
            rows.append({"module": module, "node": node, **where, "rank": rank, "scaling": scalings[module]})
    for row in experts.values():
        rows.append({**row, **{k: sorted(row[k], key=lambda v: (v is None, v))
                               for k in ("experts", "ranks", "scalings")}})
    return rows


def _module_cells(row: Row) -> Row:
    """A module row as the table shows it."""
    if "experts" in row:
        found = row["experts"]
        slices = f"{len(found)} experts" if found == list(range(len(found))) else \
            f"experts {','.join(map(str, found))}"
        return {**row, "slice": slices, "rank": _joined(row["ranks"]), "scaling": _joined(row["scalings"])}
    s = row["slice"]
    slices = "-" if row["target"] is None else "all" if s is None else \
        ",".join(map(str, s)) if isinstance(s, list) else str(s)
    return {**row, "target": row["target"] or "-", "layer": _shown(row["layer"]), "slice": slices,
            "rank": _shown(row["rank"]), "scaling": _shown(row["scaling"])}


def _shown(v: Any) -> str:
    return "-" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


def _joined(values: Sequence[Any]) -> str:
    return ",".join(map(_shown, values))


def _cells(row: Row, verdict: str) -> Row:
    """An adapter row as a table shows it: sizes in units, the digest cut (--json has it whole)."""
    out = {**row, "rank": _shown(row["rank"]), "scaling": _shown(row["scaling"]), "targets": ",".join(row["targets"]),
           "size": "" if row["file_bytes"] is None else size(row["file_bytes"]), "verdict": verdict}
    for field in ("host_bytes", "expert_bytes"):
        if row.get(field) is not None:
            out[field.replace("_", " ")] = size(row[field])
    if row.get("digest"):
        out["digest"] = row["digest"][:16]
    return out


def _json(rows: list[Row]) -> str:
    import json

    return json.dumps([{k: v for k, v in r.items() if k != "reasons"} for r in rows], indent=2)


def cmd_inspect(args: argparse.Namespace) -> int:
    specs = model_specs(args)
    if not args.adapters:  # the model alone: the targets it serves
        rows = target_rows(specs)
        print(_json(rows) if args.json else table([target_cells(r) for r in rows], COLUMNS))
        return 0
    adapters = named_adapters(args.adapters)
    per_module = args.modules or len(adapters) == 1
    rows = []
    for name, path in adapters.items():
        row, ckpt = adapter_row(specs, name, path)
        if ckpt is not None:
            with ckpt:  # one file open at a time, however many adapters
                try:
                    if per_module:
                        row["modules"] = module_rows(specs, ckpt)
                except ValueError as e:
                    row.update(verdict="refused", reason=str(e), reasons=[str(e)])
        rows.append(row)
    if args.json:
        print(_json(rows))
    else:
        print(table([_cells(r, "ok" if r["verdict"] == "ok" else "refused: " + "; ".join(r["reasons"]))
                     for r in rows], ["adapter", "rank", "scaling", "targets", "size", "verdict"]))
        for row in rows:
            if row.get("modules"):
                print(f"\n{row['adapter']}:")
                print(table([_module_cells(m) for m in row["modules"]],
                            ["module", "node", "target", "layer", "slice", "rank", "scaling"]))
    return 0 if all(r["verdict"] == "ok" for r in rows) else 1


def _digest(row: Row, ckpt: Checkpoint, nodes: list[LoraSpec], layouts: dict[str, SlotLayout]) -> None:
    """row's digest and host bytes, by check_checkpoint: it reads and hashes every byte."""
    try:
        row["digest"] = check_checkpoint(nodes[0], ckpt, nodes[1:]).hex()
        row["host_bytes"] = sum(host_bytes(ckpt, layout) for layout in layouts.values())
        if "experts" in layouts:
            row["expert_bytes"] = host_bytes(ckpt, layouts["experts"])
    except (ValueError, OSError) as e:  # a file changed or gone since its header was read
        why = str(e) if isinstance(e, ValueError) else str(ckpt.refusal([e.strerror or str(e)]))
        row.update(verdict="refused", reason=why, digest=None, host_bytes=None)


def cmd_check(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    specs = model_specs(args)
    adapters = named_adapters(args.adapters, args.serving)
    if not adapters:
        raise UsageError("no adapters named (ADAPTER arguments or --serving FILE)")
    nodes = list(specs.values())
    layouts = {name: SlotLayout(spec, dtype=spec.dtype) for name, spec in specs.items()}
    rows = []
    for name, path in tqdm(adapters.items(), desc="checking", unit="adapter", disable=None, file=sys.stderr):
        row, ckpt = adapter_row(specs, name, path)
        row.update(digest=None, host_bytes=None, **({"expert_bytes": None} if "experts" in layouts else {}))
        if ckpt is not None:
            with ckpt:  # one file open at a time, however many adapters
                if row["verdict"] == "ok":
                    _digest(row, ckpt, nodes, layouts)
        rows.append(row)
    bad = [r for r in rows if r["verdict"] != "ok"]
    if args.json:
        print(_json(rows))
    else:
        extra = ["expert bytes"] if "experts" in layouts else []
        print(table([_cells(r, r["verdict"]) for r in rows],
                    ["adapter", "rank", "targets", "size", "host bytes", *extra, "digest", "verdict"]))
        total = sum(r["host_bytes"] for r in rows if r["verdict"] == "ok")
        served = len(rows) - len(bad)
        print(f"\nhost bytes of the {served} adapter{'s' if served != 1 else ''} served: {size(total)} at max_rank "
              f"{args.max_rank} ({total} bytes, world size 1, {nodes[0].dtype})")
    if bad:
        print(f"\n{unservable([r['reason'] for r in bad], len(rows))}", file=sys.stderr)
        return 1
    return 0
