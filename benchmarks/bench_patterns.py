"""One pass of matching a config's patterns over a Qwen3-30B-A3B per-expert adapter's 18,432 module names
(AdapterConfig.module_rules: rank, scaling, targeted for each), against the same pass with only plain keys.

Run: .venv/bin/python benchmarks/bench_patterns.py
Each line is a config; medians of 9 interleaved runs, in one run, with the steps the pass took of its
budget. "costly" is issue 29's key (4,045 states), refused when its steps pass the budget: its time is the
most any config's patterns can cost on these names.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import ms, side_by_side

from mstar.engine.resources.lora import patterns
from mstar.engine.resources.lora.adapter_config import parse_config

NAMES = [f"model.layers.{layer}.mlp.experts.{e}.{p}" for layer in range(48) for e in range(128)
         for p in ("gate_proj", "up_proj", "down_proj")]
COSTLY = "(?:.*){1800}(?:" + "|".join(f".*{d}.{{40}}" for d in range(10)) + ")"
CONFIGS = {
    "plain keys": {"rank_pattern": {"gate_proj": 2, "experts.1.up_proj": 4}},
    "target regex": {"target_modules": r".*\.(gate_proj|up_proj|down_proj)"},
    "lookahead": {"target_modules": r"^(?!.*visual).*"},
    "negative lookahead": {"target_modules": r"model\.layers\.(?!0\.)\d+\.mlp\.experts\.\d+\.\w+_proj"},
    "lookbehind": {"target_modules": r".*(?<=experts\.\d)\.(gate_proj|up_proj)"},
    "regex keys": {"rank_pattern": {r"layers\.\d{1,2}\.mlp\.experts\.1\d\..*": 2, r"(up|down)_proj": 4},
                   "alpha_pattern": {r"x?gate_proj": 8, r"(?<=experts\.)\d+\.up_proj": 3}},
    "costly": {"rank_pattern": {COSTLY: 4}},
}


def rules(config):
    try:
        return config.module_rules(NAMES)
    except ValueError as e:
        return str(e)


def main() -> None:
    configs = {k: parse_config({"peft_type": "LORA", "r": 8, **v}) for k, v in CONFIGS.items()}
    budget = patterns.BASE_WORK + patterns.WORK_PER_CHAR * sum(len(n) + 1 for n in NAMES)
    print(f"{len(NAMES)} names, a budget of {budget:,} steps")
    times = side_by_side({k: (lambda c=c: rules(c)) for k, c in configs.items()}, repeat=9)
    base = times["plain keys"]
    for k, t in times.items():
        outcome = rules(configs[k])
        print(f"{k:20} {ms(t):>12}  {t / base:6.1f}x plain keys  {'refused' if isinstance(outcome, str) else 'served'}")


if __name__ == "__main__":
    main()
