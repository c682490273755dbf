"""The `redraft` command: one entry point, subcommands registered by each package.

The datastore side registers `index`, `query`, `stats` and `serve`; the decoder side
`generate`, `bench` and `train-medusa`. Errors a user can cause are printed as one line
(exit 2), never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from redraft.datastore.errors import RedraftError


def build_parser() -> argparse.ArgumentParser:
    from redraft.datastore import cli as datastore_cli

    parser = argparse.ArgumentParser(
        prog="redraft",
        description="Retrieval-based speculative decoding: faster generation, same output.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    datastore_cli.register(sub)
    register(sub)
    return parser


def register(sub: argparse._SubParsersAction) -> None:
    """Add the decoder's subcommands (generate, bench, train-medusa) to the `redraft` parser."""
    from redraft.decoder import bench, commands, medusa_command

    commands.register(sub)
    bench.register(sub)
    medusa_command.register(sub)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
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


if __name__ == "__main__":
    sys.exit(main())
