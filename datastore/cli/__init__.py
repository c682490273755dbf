"""The datastore's commands: `redraft index`, `query`, `stats` (here) and `serve` (the
service's own, `redraft.datastore.service.serve_cli`).

User errors are raised as RedraftError subclasses; the `redraft` dispatcher prints them as
one line and exits 2.
"""

from __future__ import annotations

import argparse

from redraft.datastore.cli import index_cli, query_cli, stats_cli
from redraft.datastore.cli.client_options import add_client_options

COMMANDS = ("index", "query", "stats")
__all__ = ["COMMANDS", "add_client_options", "register"]


def register(sub: argparse._SubParsersAction, command: str | None = None) -> None:
    """Add the datastore's subcommands to the `redraft` parser. Given the `command` about
    to run, `serve` is left out unless it could be that command: its module imports gRPC,
    a fifth of a second that `stats` or `query` would otherwise pay at every start."""
    index_cli.register(sub)
    query_cli.register(sub)
    stats_cli.register(sub)
    if command in COMMANDS:
        return
    try:
        # lazy: gRPC, only when `serve` could be the command
        from redraft.datastore.service import serve_cli
    except ModuleNotFoundError as exc:
        if exc.name not in ("redraft.datastore.service", "redraft.datastore.service.serve_cli"):
            raise
    else:
        serve_cli.register(sub)
