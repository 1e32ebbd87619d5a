"""mstar-lora: inspect and check adapters against a model, and run the demo."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from ..check import adapter_problems, check_checkpoint, inspect_checkpoint, module_rank, module_reasons
from ..checkpoint import Checkpoint, default_name, open_checkpoint
from ..layout import SlotLayout
from ..models import presets, specs_from_config
from ..plan import host_bytes
from ..spec import LoraSpec
from .table import size, table


def _adapters(args: Sequence[str]) -> dict[str, str]:
    """NAME=PATH or PATH (named after its directory) arguments."""
    out = {}
    for arg in args:
        name, sep, path = arg.partition("=")
        if not sep:
            name, path = default_name(arg), arg
        out[name] = path
    return out


def serving_config(path: str) -> dict[str, str]:
    """The adapters a serving config names: a JSON object of name -> path, or one whose "adapters" is."""
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"serving config {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"serving config {path}: not valid JSON ({e})") from None
    adapters = raw.get("adapters", raw) if isinstance(raw, dict) else raw
    if not isinstance(adapters, dict) or not all(isinstance(v, str) for v in adapters.values()):
        what = "an object with values that are not paths" if isinstance(adapters, dict) else \
            f"a JSON {type(adapters).__name__}"
        raise ValueError(f'serving config {path}: needs an object of adapter name -> path (or one under '
                         f'"adapters"), not {what}')
    return adapters


def _row(specs: dict[str, LoraSpec], name: str, path: str) -> tuple[dict, list[str], Checkpoint | None]:
    """The table row of one adapter from its header alone, why it cannot be served (if so), and the
    checkpoint opened (None if it could not be)."""
    row: dict = {"adapter": name, "path": path}
    try:
        ckpt = open_checkpoint(path, name)
    except ValueError as e:
        return row, [str(e)], None
    row["size"] = size(ckpt.size)
    nodes = list(specs.values())
    try:  # what cannot be inspected (an alpha that is not a number, say) is a reason like any other
        infos = [inspect_checkpoint(spec, ckpt) for spec in nodes]
        row["rank"] = max(i.rank for i in infos)
        row["scaling"] = f"{ckpt.scaling(nodes[0].convert_keys):g}"
        problems = adapter_problems(nodes, ckpt)
    except ValueError as e:
        return row, [str(e)], None
    touched = [{spec.locate(m).target for m in problems if spec.locate(m)} | i.targets
               for spec, i in zip(nodes, infos, strict=True)]
    row["targets"] = ",".join(t for ts in touched for t in sorted(ts))
    return row, module_reasons(problems) if problems else [], ckpt


def module_rows(specs: dict[str, LoraSpec], ckpt: Checkpoint) -> list[dict]:
    """Each module of the checkpoint as the nodes read it: target, layer, slice, rank and scaling; expert
    modules one row per target and layer, not thousands."""
    rows, experts = [], {}
    for node, spec in specs.items():
        scalings = ckpt.scalings(spec.convert_keys)
        for module, keys in sorted(ckpt.modules(spec.convert_keys).items()):
            loc = spec.locate(module)
            if loc is None and len(specs) > 1:
                continue
            a = keys.roles.get("A")
            rank = module_rank(spec, loc, a.shape) if a is not None and a.shape else "-"
            t = spec.targets[loc.target] if loc else None
            if t is not None and t.experts is not None:
                per = t.slices // t.experts.count
                row = experts.setdefault((node, loc.target, loc.layer), {
                    "module": re.sub(r"\.experts\..*", ".experts.*", module), "node": node, "target": loc.target,
                    "layer": loc.layer, "experts": set(), "ranks": set(), "scalings": set()})
                row["experts"].update(range(t.experts.count) if loc.slice is None else [loc.slice // per])
                row["ranks"].add(rank)
                row["scalings"].add(f"{scalings[module]:g}")
                continue
            where = {"target": "-", "layer": "-", "slice": "-"} if loc is None else \
                {"target": loc.target, "layer": loc.layer, "slice": _slices(loc.slice)}
            rows.append({"module": module, "node": node, **where, "scaling": f"{scalings[module]:g}", "rank": rank})
    for row in experts.values():
        found = sorted(row.pop("experts"))
        row["slice"] = f"{len(found)} experts" if found == list(range(len(found))) else \
            f"experts {','.join(map(str, found))}"
        row["rank"] = ",".join(map(str, sorted(row.pop("ranks"))))
        row["scaling"] = ",".join(sorted(row.pop("scalings")))
        rows.append(row)
    return rows


def _slices(s: int | tuple[int, ...] | None) -> str:
    return "all" if s is None else str(s) if isinstance(s, int) else ",".join(map(str, s))


def cmd_inspect(args: argparse.Namespace) -> int:
    specs = specs_from_config(args.model, max_rank=args.max_rank, max_expert_rank=args.max_expert_rank)
    adapters = _adapters(args.adapters)
    per_module = args.modules or len(adapters) == 1
    rows = []
    for name, path in adapters.items():
        row, problems, ckpt = _row(specs, name, path)
        row["verdict"] = "ok" if not problems else "; ".join(problems)
        if per_module and ckpt is not None:
            row["modules"] = module_rows(specs, ckpt)
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0 if all(r["verdict"] == "ok" for r in rows) else 1
    print(table(rows, ["adapter", "rank", "scaling", "targets", "size", "verdict"]))
    for row in rows:
        if row.get("modules"):
            print(f"\n{row['adapter']}:")
            print(table(row["modules"], ["module", "node", "target", "layer", "slice", "rank", "scaling"]))
    return 0 if all(r["verdict"] == "ok" for r in rows) else 1


def cmd_check(args: argparse.Namespace) -> int:
    specs = specs_from_config(args.model, max_rank=args.max_rank, max_expert_rank=args.max_expert_rank)
    adapters = _adapters(args.adapters)
    if args.serving:
        adapters.update(serving_config(args.serving))
    if not adapters:
        print("mstar-lora check: no adapters named (ADAPTER arguments or --serving FILE)", file=sys.stderr)
        return 2
    nodes = list(specs.values())
    layouts = {name: SlotLayout(spec, dtype=spec.dtype) for name, spec in specs.items()}
    rows, bad, total = [], [], 0
    for name, path in tqdm(adapters.items(), desc="checking", unit="adapter", disable=None, file=sys.stderr):
        row, problems, ckpt = _row(specs, name, path)
        try:
            if problems:
                raise ckpt.refusal(problems) if ckpt is not None else ValueError(problems[0])
            row["digest"] = check_checkpoint(nodes[0], ckpt, nodes[1:]).hex()[:16]
            row["host_bytes"] = sum(host_bytes(ckpt, layout) for layout in layouts.values())
            row["host bytes"] = size(row["host_bytes"])
            if "experts" in layouts:
                row["expert_bytes"] = host_bytes(ckpt, layouts["experts"])
                row["expert bytes"] = size(row["expert_bytes"])
            total += row["host_bytes"]
            row["verdict"] = "ok"
        except ValueError as e:
            row["verdict"] = "refused"
            row["reason"] = str(e)
            bad.append(str(e))
        rows.append(row)
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k not in ("host bytes", "expert bytes")} for r in rows],
                         indent=2))
    else:
        extra = ["expert bytes"] if "experts" in layouts else []
        print(table(rows, ["adapter", "rank", "targets", "size", "host bytes", *extra, "digest", "verdict"]))
        print(f"\nhost bytes of the {len(rows) - len(bad)} adapters served: {size(total)} at max_rank "
              f"{args.max_rank} ({total} bytes, world size 1, {nodes[0].dtype})")
    if bad:
        print(f"\n{len(bad)} of {len(rows)} adapters cannot be served:", file=sys.stderr)
        for b in bad:
            print(b, file=sys.stderr)
        return 1
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mstar-lora", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    model_help = f"a config.json path or a preset: {', '.join(presets())}"
    for name, fn, help_ in (("inspect", cmd_inspect, "what adapters hold, from their headers"),
                            ("check", cmd_check, "the startup check: every adapter, with its digest")):
        c = sub.add_parser(name, help=help_)
        c.add_argument("model", help=model_help)
        c.add_argument("adapters", nargs="+" if name == "inspect" else "*", metavar="ADAPTER",
                       help="an adapter directory or safetensors file, optionally NAME=PATH")
        c.add_argument("--max-rank", type=int, default=64, help="the pool's max_rank (default 64)")
        c.add_argument("--max-expert-rank", type=int, help="a mixture of experts' max_rank for experts "
                                                          "(default: --max-rank)")
        c.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "check":
            c.add_argument("--serving", help="a JSON file mapping adapter names to paths")
        else:
            c.add_argument("--modules", action="store_true",
                           help="each module's target, rank and scaling too (the default for one adapter)")
        c.set_defaults(fn=fn)
    from .demo_models import model_help as demo_model_help

    d = sub.add_parser("demo", help="the manager serving a trace on a tiny model, checked against PEFT")
    d.add_argument("--model", default="tiny-llama", help=demo_model_help())
    d.add_argument("--keep", help="write the sample adapters here (and keep them) instead of a temporary folder")
    d.set_defaults(fn=cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as e:
        print(f"mstar-lora: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
