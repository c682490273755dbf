"""The options of a command that talks to a draft service (`stats --server`, `generate
--draft-service`, `bench --draft-service`): its token and its TLS, declared once.

Registering them imports no gRPC: `redraft stats DIR` starts without it. The values are
resolved by `redraft.datastore.service.client.client_token` and `client_tls`.

Tested by: tests/datastore/service/test_client.py, tests/decoder/cli/test_generate_cli.py
"""

from __future__ import annotations

import argparse

TOKEN_ENV = "REDRAFT_TOKEN"  # the client's `TOKEN_ENV`, named here without importing gRPC


def add_client_options(parser: argparse.ArgumentParser) -> None:
    """--token, --token-file, --tls and --tls-ca, in one argument group."""
    group = parser.add_argument_group("draft service connection")
    group.add_argument("--token", default=None,
                       help="shared secret for the draft service (visible to `ps`: prefer "
                       f"--token-file or ${TOKEN_ENV})")
    group.add_argument("--token-file", default=None, metavar="FILE",
                       help=f"file holding the shared secret (default: ${TOKEN_ENV})")
    group.add_argument("--tls", action="store_true",
                       help="connect with TLS, trusting the system's certificate authorities")
    group.add_argument("--tls-ca", default=None, metavar="FILE",
                       help="connect with TLS, trusting this PEM certificate (the server's "
                       "own, or its CA's)")
