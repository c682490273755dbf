"""The `redraft` command: one entry point, subcommands registered by each package.

The datastore side registers `index`, `query`, `stats` and `serve`; the decoder side
`generate`, `bench` and `train-medusa`. Only the subcommands that could parse the command
line are registered: the decoder's modules import torch and `serve`'s imports gRPC, neither of
which `redraft stats DIR` needs at start. Errors a user can cause are printed as one line
(exit 2), never a traceback.

Tested by: tests/proto/test_config_file.py, tests/datastore/cli/test_datastore_cli.py
"""

from __future__ import annotations

import argparse
import sys

from redraft.datastore import cli as datastore_cli
from redraft.proto.errors import RedraftError


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The `redraft` parser; with `argv`, only the subcommands that can parse it."""
    parser = argparse.ArgumentParser(
        prog="redraft",
        description="Retrieval-based speculative decoding: faster generation, same output.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    command = argv[0] if argv else None  # the top level has no options but --help
    datastore_cli.register(sub, command)
    if command not in sub.choices:  # a decoder command, --help, or a mistake to report
        register(sub)
    return parser


def register(sub: argparse._SubParsersAction) -> None:
    """Add the decoder's subcommands (generate, bench, train-medusa) to the `redraft` parser."""
    # lazy: the decoder's commands import torch; `redraft stats DIR` and the other datastore
    # commands must start without it
    from redraft.decoder.cli import bench_cli, generate_cli, train_medusa_cli

    generate_cli.register(sub)
    bench_cli.register(sub)
    train_medusa_cli.register(sub)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # Paths that are not UTF-8 reach us as surrogate escapes: print them, never crash on them.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except RedraftError as exc:
        print(f"redraft {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"redraft {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
