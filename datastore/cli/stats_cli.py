"""`redraft stats`: a datastore's manifest (its segments, and every shard) and sizes, or a
running service's counters.

Tested by: tests/datastore/cli/test_datastore_cli.py, tests/datastore/test_commit.py,
tests/datastore/service/test_client.py"""

from __future__ import annotations

import argparse
import json
import os
import sys

from redraft.datastore.cli.client_options import add_client_options
from redraft.datastore.reader import Reader
from redraft.proto.errors import RedraftError


def register(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("stats", help="print a datastore's manifest, segments and sizes as JSON")
    s.add_argument("datastore", metavar="DIR", nargs="?")
    s.add_argument("--server", metavar="ADDR",
                   help="print a running draft service's counters instead")
    s.add_argument("--no-verify", action="store_true",
                   help="skip checking the arrays' checksums (which reads every segment)")
    add_client_options(s)
    s.set_defaults(func=cmd_stats)


def cmd_stats(args: argparse.Namespace) -> int:
    if args.server:
        # lazy: gRPC only for --server (`redraft stats DIR` starts without it)
        from redraft.datastore.service.serve_cli import print_server_stats

        return print_server_stats(args.server, args.token, args.token_file, args.tls,
                                  args.tls_ca)
    if not args.datastore:
        raise RedraftError("stats needs a datastore DIR or --server ADDR")

    with Reader(args.datastore, verify=not args.no_verify) as r:
        size = r.files_bytes
        m = dict(r.manifest)
        n = max(1, m["n_tokens"])
        m["path"] = os.path.abspath(args.datastore)
        m["layout"] = "single file (legacy; `redraft index --upgrade` converts it)" \
            if r.layout == "legacy" else "segments"
        m["sizes"] = {
            "file_bytes": size,
            "bytes_per_token": round(size / n, 4),
            "token_bytes": sum(s["length"] for s in m["shards"]) * r._dtype.itemsize,
            "suffix_array_bytes": sum(s["length"] for s in m["shards"]) * 4,
        }
        m["verified"] = not args.no_verify
    json.dump(m, sys.stdout, indent=2)
    print()
    return 0
