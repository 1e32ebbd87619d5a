"""mstar-lora: inspect and check adapters against a model, and run the demo."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

# Only what --help and argument errors need is imported here: no torch, which takes seconds to import.
from ..models import presets

EXIT_CODES = """exit status:
  0  every adapter named was checked and can be served
  1  an adapter cannot be served (each one is named, with every reason)
  2  the command is wrong: an unknown option or preset, a model config or --serving file that cannot be
     read, two adapters of one name, a --max-rank that is not a positive integer"""
FORMAT = argparse.RawDescriptionHelpFormatter


class UsageError(ValueError):
    """The command is wrong rather than an adapter (exit 2, as argparse's own errors)."""


def positive(text: str) -> int:
    """An argparse type: an integer from 1 (a rank of 0 is no pool, and never means "the default")."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return n


def model_argument(text: str) -> str:
    """An argparse type: a path that is there, or a preset's name (what the path holds is read later)."""
    if not os.path.lexists(text) and text not in presets():
        raise argparse.ArgumentTypeError(f"{text!r} is neither a config file, a model folder nor a preset "
                                         f"({', '.join(presets())})")
    return text


def parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command's parser, and each subcommand's."""
    p = argparse.ArgumentParser(prog="mstar-lora", description=__doc__, epilog=EXIT_CODES, formatter_class=FORMAT)
    sub = p.add_subparsers(dest="command", required=True)
    model_help = (f"a config.json or a model folder (with its config.json) of any architecture transformers can "
                  f"build (its spec derived from the model), or a preset: {', '.join(presets())}")
    commands = {}
    for name, help_ in (("inspect", "what adapters hold, from their headers; with none, the targets the model "
                                    "serves (name, layers, widths, sharding)"),
                        ("check", "the startup check: every adapter, with its digest")):
        c = sub.add_parser(name, help=help_, description=help_, epilog=EXIT_CODES, formatter_class=FORMAT)
        c.add_argument("model", metavar="MODEL", type=model_argument, help=model_help)
        c.add_argument("adapters", nargs="*", metavar="ADAPTER",
                       help="an adapter directory, safetensors file or Hub id, optionally NAME=PATH (a path "
                            "that exists is a path, = and all)")
        c.add_argument("--max-rank", type=positive, default=64, help="the pool's max_rank (default 64)")
        c.add_argument("--max-expert-rank", type=positive, help="a mixture of experts' max_rank for experts "
                                                               "(default: --max-rank)")
        c.add_argument("--json", action="store_true", help="one JSON object per adapter (see the README)")
        if name == "check":
            c.add_argument("--serving", metavar="FILE", help="a JSON file mapping adapter names to paths")
        else:
            c.add_argument("--modules", action="store_true",
                           help="each module's target, rank and scaling too (the default for one adapter)")
        commands[name] = c
    from .demo_models import model_help as demo_model_help

    d = sub.add_parser("demo", help="the manager serving a trace on a tiny model, checked against PEFT")
    d.add_argument("--model", default="tiny-llama", help=demo_model_help())
    d.add_argument("--keep", help="write the sample adapters here (and keep them) instead of a temporary folder")
    commands["demo"] = d
    return p, commands


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The arguments, options taken anywhere among inspect's and check's adapters (`check MODEL --max-rank
    16 ADAPTER`), which argparse's plain parse refuses once a list of positionals has begun."""
    top, commands = parsers()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("inspect", "check"):
        args = commands[argv[0]].parse_intermixed_args(argv[1:])
        args.command = argv[0]
        return args
    return top.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    try:
        if args.command == "demo":
            from .demo import run_demo

            return run_demo(args)
        from .commands import cmd_check, cmd_inspect

        return (cmd_check if args.command == "check" else cmd_inspect)(args)
    except UsageError as e:
        print(f"mstar-lora {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"mstar-lora: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
