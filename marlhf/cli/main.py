"""``marlhf SUBCOMMAND [flags]``: dispatch to ``marlhf.cli.<module>.main`` (the console script)."""

from __future__ import annotations

import importlib
import sys

from marlhf.cli import COMMANDS, RENAMED
from marlhf.errors import run_cli


def version() -> str:
    """The installed distribution's version (setup.py declares it once)."""
    from importlib import metadata

    try:
        return metadata.version("marlhf")
    except metadata.PackageNotFoundError:  # imported from a source tree that was never installed
        return "unknown (not installed: pip install -e .)"


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: marlhf SUBCOMMAND [flags]   (marlhf SUBCOMMAND --help lists its flags; marlhf --version)", "",
             "RLHF with macro actions (MA-PPO) on DeepSpeed.", "", "subcommands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "Several GPUs or nodes: deepspeed [--num_gpus N | --hostfile H] --module marlhf.cli.<sft|rm|dpo|ppo> "
              "[flags]"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"marlhf {version()}")
        return 0
    name, rest = argv[0], argv[1:]
    if name in RENAMED:
        print(f"marlhf: '{name}' is now 'marlhf {RENAMED[name]}'", file=sys.stderr)
        name = RENAMED[name]
    if name not in COMMANDS:
        close = [c for c in COMMANDS if c.replace("-", "_") == name.replace("-", "_")]
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        print(f"marlhf: unknown subcommand '{name}'{hint}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"marlhf.cli.{COMMANDS[name][0]}")
    sys.argv = [f"marlhf {name}", *rest]  # argparse names the program after argv[0] in usage and errors
    return run_cli(module.main, rest)


if __name__ == "__main__":
    sys.exit(main())
