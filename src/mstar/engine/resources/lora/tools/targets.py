"""What `mstar-lora inspect MODEL` shows with no adapter named: every target the model's specs serve (its
name, the layers holding it, its widths and how it shards), so a user sees what will be served first."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..spec import LoraSpec, LoraTarget

COLUMNS = ["node", "target", "layers", "in", "out", "sharding"]


def target_rows(specs: Mapping[str, LoraSpec]) -> list[dict[str, Any]]:
    """One row per target of every node, as --json gives it."""
    return [{"node": node, "target": name, **_fields(t)} for node, spec in specs.items()
            for name, t in spec.targets.items()]


def _fields(t: LoraTarget) -> dict[str, Any]:
    return {"layers": list(t.layer_ids) if t.layer_ids is not None else t.layers, "in": t.in_features,
            "out": list(t.out_features), "parallel": t.parallel, "heads": None if t.heads is None else list(t.heads),
            "kernel": None if t.kernel is None else list(t.kernel),
            "experts": None if t.experts is None else t.experts._asdict()}


def target_cells(row: Mapping[str, Any]) -> dict[str, str]:
    """A target row as the table shows it: layers as a count (or the layers that have it), a stacked
    target's widths per expert, heads beside a sharding by heads."""
    layers = row["layers"]
    out, experts = row["out"], row["experts"]
    if experts:
        per = len(out) // experts["count"]
        widths = f"{experts['count']} experts x {_widths(out[:per])}"
    else:
        widths = _widths(out)
    sharding = row["parallel"] + (f" by heads {_widths(row['heads'])}" if row["heads"] else "")
    return {"node": row["node"], "target": row["target"], "in": str(row["in"]), "out": widths, "sharding": sharding,
            "layers": str(layers) if isinstance(layers, int) else f"{len(layers)}: {_runs(layers)}"}


def _widths(values: Sequence[Any]) -> str:
    return str(values[0]) if len(values) == 1 else "(" + ", ".join(map(str, values)) + ")"


def _runs(layers: Sequence[int]) -> str:
    """0-2,5,7-9 for [0, 1, 2, 5, 7, 8, 9]."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in runs)
