"""`redraft index`: build a datastore from corpora, append to it, or delete documents.

Tested by: tests/datastore/cli/test_datastore_cli.py, tests/datastore/test_commit.py,
tests/datastore/test_ray_build.py"""

from __future__ import annotations

import argparse
import re
import time

from redraft.datastore.build import (
    DEFAULT_RAY_RETRIES,
    DEFAULT_SHARD_TOKENS,
    append_corpus,
    build_datastore,
    delete_documents,
)
from redraft.datastore.commit import DEFAULT_WAIT_S, upgrade_datastore
from redraft.datastore.manifest import PICKUP_BOUND_S
from redraft.datastore.reader import Reader
from redraft.proto.config_file import add_config_options, print_config
from redraft.proto.errors import InvalidQuery
from redraft.proto.models import DEFAULT_MODEL


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("index", help="build a datastore from corpora (or append / delete)",
                       description="Tokenize corpora with the target model's tokenizer and "
                       "index them as suffix arrays in an LMDB datastore. Replaces any "
                       "datastore at --out atomically unless --append, --delete or --upgrade "
                       "is given.")
    p.add_argument("inputs", nargs="*", metavar="INPUT",
                   help="files, directories (recursive) or globs; .jsonl: one record per document")
    p.add_argument("--out", metavar="DIR", help="datastore directory")
    p.add_argument("--tokenizer", metavar="MODEL", default=None,
                   help=f"model whose tokenizer to use (default: {DEFAULT_MODEL}; with --append: "
                   "the datastore's)")
    p.add_argument("--corpus", default="default", metavar="NAME",
                   help="name of this corpus, for restricting lookups (default: default)")
    p.add_argument("--field", default=None, metavar="NAME",
                   help=".jsonl field holding the text (default: text, then messages/turns, "
                   "then question+answer)")
    p.add_argument("--append", action="store_true", help="add to the existing datastore")
    p.add_argument("--delete", metavar="IDS", default=None,
                   help="delete these comma-separated document ids (their tokens are removed) "
                   "instead of indexing")
    p.add_argument("--upgrade", metavar="DIR", default=None,
                   help="convert the single-file datastore (datastore.lmdb) in DIR to segments "
                   "in place (idempotent; any write does it first anyway)")
    p.add_argument("--wait", type=float, default=DEFAULT_WAIT_S, metavar="SECONDS",
                   help="how long to wait while another process writes the datastore "
                   f"(default {DEFAULT_WAIT_S:g})")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="leave out files matching GLOB (repeatable)")
    p.add_argument("--skip-bad", action="store_true",
                   help="skip unreadable or non-UTF-8 files and malformed .jsonl records with a "
                   "warning instead of failing")
    p.add_argument("--shard-tokens", type=int, default=None, metavar="N",
                   help="maximum tokens per shard (default: 128 Mi)")
    p.add_argument("--ray", nargs="?", const=True, default=None, metavar="ADDRESS",
                   help="tokenize and sort on a Ray cluster (HOST:PORT, ray://HOST:PORT or "
                   "auto; none: the cluster `ray.init()` finds or starts on this machine); "
                   "the datastore directory and the inputs must be on storage every node "
                   "sees. Needs pip install 'redraft[ray]'")
    p.add_argument("--ray-retries", type=int, default=DEFAULT_RAY_RETRIES, metavar="N",
                   help="with --ray: how often a task whose worker died is run again "
                   f"(default {DEFAULT_RAY_RETRIES}; 0: the build fails instead)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    add_config_options(p, "index")
    p.set_defaults(func=cmd_index, config_parser=p)


def cmd_index(args: argparse.Namespace) -> int:
    if getattr(args, "print_config", False):
        print_config(args.config_parser, args)
        return 0
    progress = not args.quiet
    t0 = time.perf_counter()
    if not args.wait >= 0 or args.wait == float("inf"):
        raise InvalidQuery(f"--wait: expected a finite number of seconds >= 0, got {args.wait}")
    if args.upgrade is not None:
        if args.inputs or args.append or args.delete is not None or args.ray is not None or \
                args.out not in (None, args.upgrade):
            raise InvalidQuery("--upgrade DIR takes no inputs, --out, --append, --delete or "
                               "--ray")
        return _upgrade(args.upgrade, args.wait)
    if args.out is None:
        raise InvalidQuery("--out DIR is required")
    if args.ray_retries < 0:
        raise InvalidQuery(f"--ray-retries: expected an integer >= 0, got {args.ray_retries}")
    if args.delete is not None:
        if args.inputs or args.append or args.ray is not None:
            raise InvalidQuery("--delete takes no inputs, no --append and no --ray")
        return _delete(args.out, set(int_list(args.delete, "--delete")), args.wait)
    common = dict(tokenizer=args.tokenizer, corpus=args.corpus, field=args.field,
                  exclude=args.exclude, skip_bad=args.skip_bad, progress=progress,
                  wait_s=args.wait, ray=_ray_address(args.ray), ray_retries=args.ray_retries)
    if args.append:
        m = append_corpus(args.inputs, args.out, shard_tokens=args.shard_tokens, **common)
        verb = "appended to"
    else:
        m = build_datastore(args.inputs, args.out,
                            shard_tokens=args.shard_tokens or DEFAULT_SHARD_TOKENS, **common)
        verb = "built"
    last = m["build"]["history"][-1]
    skipped = last.get("skipped", 0)
    print(f"{verb} {args.out}: +{last['n_docs']:,} documents, +{last['n_tokens']:,} tokens "
          f"(corpus {args.corpus}); total {m['n_docs']:,} documents, {m['n_tokens']:,} tokens "
          f"in {m['n_shards']} shard(s), {m['n_segments']} segment(s), "
          f"{time.perf_counter() - t0:.1f} s"
          + (f"; skipped {skipped:,} bad file(s) or record(s)" if skipped else "")
          + _ray_summary(last.get("ray")))
    return 0


# HOST:PORT (a name, IPv4 or [IPv6] address), optionally ray://, or Ray's own keywords
_RAY_ADDRESS = re.compile(r"(ray://)?([\w.-]+|\[[0-9a-fA-F:.]+\]):[0-9]{1,5}|auto|local")


def _ray_address(value: str | bool | None) -> str | bool | None:
    """--ray's value: True (no address) or an address. Anything else is refused, since
    `--ray DIR/` would otherwise silently swallow an input."""
    if value is None or value is True or _RAY_ADDRESS.fullmatch(value):
        return value
    raise InvalidQuery(f"--ray: {value!r} is not a cluster address (HOST:PORT, "
                       "ray://HOST:PORT, auto or local); with no address, put --ray after "
                       "the inputs")


def _ray_summary(report: dict | None) -> str:
    if not report:
        return ""
    retried = report.get("retried", 0)
    return (f"; on Ray: {report['tasks']} task(s) on {len(report['nodes'])} node(s)"
            + (f", {retried} retried after a worker died" if retried else ""))


def _delete(out: str, ids: set[int], wait_s: float) -> int:
    if not ids:
        raise InvalidQuery("--delete: no document ids given")
    with Reader(out) as r:
        before = len(r.deleted)
    m = delete_documents(out, ids, wait_s=wait_s)
    new = m["n_deleted"] - before
    already = f" ({len(ids) - new} already deleted)" if len(ids) > new else ""
    print(f"deleted {new} document(s){already} from {out}: {m['n_docs']:,} documents, "
          f"{m['n_tokens']:,} tokens live"
          + (f"; running servers stop drafting them within {PICKUP_BOUND_S:g} s" if new
             else ""))
    return 0


def _upgrade(path: str, wait_s: float) -> int:
    m, changed = upgrade_datastore(path, wait_s=wait_s)
    if changed:
        print(f"upgraded {path} to segments: {m['n_segments']} segment(s), "
              f"{m['n_docs']:,} documents, {m['n_tokens']:,} tokens")
    else:
        print(f"{path} is already stored as segments ({m['n_segments']} segment(s)); "
              "nothing to do")
    return 0


def int_list(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError as exc:
        raise InvalidQuery(f"{what}: expected comma-separated integers, got {text!r}") from exc
