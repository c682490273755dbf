"""The credentials a client presents and a server accepts: bearer tokens (from a flag, a
file or $REDRAFT_TOKEN, each checked to be sendable as gRPC metadata) and the client's TLS
roots. Apart from the connection (`client`) because `redraft serve` reads its tokens the
same way a client does.

Tested by: tests/datastore/service/test_client.py, tests/datastore/service/test_server.py"""

from __future__ import annotations

import os

from redraft.datastore.service.client_errors import ServiceError

TOKEN_ENV = "REDRAFT_TOKEN"  # as `redraft.datastore.cli.client_options` names it


def check_token(token: str, where: str = "token") -> None:
    """A token must be printable ASCII: gRPC sends metadata values as such, so no client
    could present any other (a server would accept it and refuse every call)."""
    if not (token.isascii() and token.isprintable()):
        raise ServiceError(f"{where}: a token must be printable ASCII (gRPC metadata "
                           "cannot carry anything else)")


def read_tokens(path: str | None) -> tuple[str, ...]:
    """The shared secrets in the file at `path` (one per line), else the one in
    $REDRAFT_TOKEN, else none; each checked (`check_token`)."""
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                tokens = tuple(line.strip() for line in f if line.strip())
        except (OSError, UnicodeDecodeError) as exc:
            raise ServiceError(f"cannot read --token-file: {exc}") from exc
        if not tokens:
            raise ServiceError(f"--token-file {path} is empty")
        where = f"--token-file {path}"
    else:
        token = os.environ.get(TOKEN_ENV)
        tokens, where = ((token,) if token else ()), f"${TOKEN_ENV}"
    for t in tokens:
        check_token(t, where)
    return tokens


def client_token(token: str | None = None, token_file: str | None = None) -> str | None:
    """The one token a client sends: `--token`, else the one in `--token-file`, else
    $REDRAFT_TOKEN, else none. A file keeps the secret out of `ps`."""
    if token is not None and token_file is not None:
        raise ServiceError("give --token or --token-file, not both")
    if token is not None:
        check_token(token, "--token")
        return token
    tokens = read_tokens(token_file)
    if len(tokens) > 1:
        raise ServiceError(f"--token-file {token_file} holds {len(tokens)} tokens; a client "
                           "sends one")
    return tokens[0] if tokens else None


def client_tls(tls: bool, tls_ca: str | None) -> bool | str:
    """`DraftClient`'s `tls` from the command line: a CA file, the system's roots, or off."""
    if tls_ca is not None:
        if not os.path.isfile(tls_ca):
            raise ServiceError(f"TLS file not found: {tls_ca}")
        return tls_ca
    return bool(tls)


