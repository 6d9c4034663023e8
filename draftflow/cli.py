"""The ``draftflow`` command: ``draftflow COMMAND ...`` runs one tool with the rest of the line."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each tool's module is imported only when its command runs: `draftflow progress`
# stays as light as the progress check itself (no torch).
COMMANDS = {
    "plan": ("draftflow.plan", "what a run will cost, stage by stage, before it starts"),
    "progress": ("draftflow.progress", "how far the hidden-state extraction is, how fast, when it ends"),
    "pilot": ("draftflow.pilot_command", "what more data buys: a small run's fit, beside the plan's cost of larger runs"),
    "gpus": ("draftflow.gpus", "claim GPUs for a command, list who holds them, count them"),
    "publish": ("draftflow.publish", "upload a drafter folder with its model card to the Hugging Face hub"),
}


def argument_parser() -> argparse.ArgumentParser:
    width = max(map(len, COMMANDS))
    listing = "\n".join(f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="draftflow",
        description="The draftflow workflow's tools.",
        epilog=f"commands:\n{listing}\n\n`draftflow COMMAND --help` shows a command's own options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=COMMANDS, metavar="COMMAND", help="one of the commands below")
    parser.add_argument("arguments", nargs=argparse.REMAINDER, help="handed to the command")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = argument_parser().parse_args(argv)
    module, _ = COMMANDS[args.command]
    prog = f"draftflow {args.command}"
    sys.argv = [prog, *args.arguments]  # as under `python -m`: gpus records the holder's command as typed
    return importlib.import_module(module).main(args.arguments, prog=prog)
