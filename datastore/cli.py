"""`redraft index`, `redraft query` and `redraft stats`.

User errors are raised as RedraftError subclasses; the `redraft` dispatcher prints them as
one line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from redraft.datastore.errors import InvalidQuery, RedraftError

COMMANDS = ("index", "query", "stats")  # `serve` comes from redraft.datastore.service.cli


def register(sub: argparse._SubParsersAction, command: str | None = None) -> None:
    """Add the datastore's subcommands to the `redraft` parser. Given the `command` about
    to run, `serve` is left out unless it could be that command: its module imports gRPC,
    a fifth of a second that `stats` or `query` would otherwise pay at every start."""
    p = sub.add_parser("index", help="build a datastore from corpora (or append / delete)",
                       description="Tokenize corpora with the target model's tokenizer and "
                       "index them as suffix arrays in an LMDB datastore. Replaces any "
                       "datastore at --out atomically unless --append or --delete is given.")
    p.add_argument("inputs", nargs="*", metavar="INPUT",
                   help="files, directories (recursive) or globs; .jsonl: one record per document")
    p.add_argument("--out", required=True, metavar="DIR", help="datastore directory")
    p.add_argument("--tokenizer", metavar="MODEL", default=None,
                   help="model whose tokenizer to use (default: smollm2-135m; with --append: "
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
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="leave out files matching GLOB (repeatable)")
    p.add_argument("--skip-bad", action="store_true",
                   help="skip unreadable or non-UTF-8 files and malformed .jsonl records with a "
                   "warning instead of failing")
    p.add_argument("--shard-tokens", type=int, default=None, metavar="N",
                   help="maximum tokens per shard (default: 128 Mi)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_index)

    q = sub.add_parser("query", help="look up a context and print the candidate tree")
    q.add_argument("--datastore", required=True, metavar="DIR")
    src = q.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="context text (tokenized with the datastore's tokenizer)")
    src.add_argument("--tokens", help="context token ids, comma-separated")
    q.add_argument("--json", action="store_true", help="print one JSON object")
    q.add_argument("--budget", type=int, default=64, help="maximum tree nodes (default 64)")
    q.add_argument("--max-depth", type=int, default=16)
    q.add_argument("--max-match-len", type=int, default=16)
    q.add_argument("--min-match-len", type=int, default=2)
    q.add_argument("--max-occurrences", type=int, default=256)
    q.add_argument("--corpus", action="append", default=None, metavar="NAME",
                   help="restrict to this corpus (repeatable)")
    q.add_argument("--tokenizer", metavar="MODEL", default=None,
                   help="tokenizer for --text (default: the one the datastore was built with)")
    q.set_defaults(func=cmd_query)

    s = sub.add_parser("stats", help="print a datastore's manifest and sizes as JSON")
    s.add_argument("datastore", metavar="DIR", nargs="?")
    s.add_argument("--server", metavar="ADDR",
                   help="print a running draft service's counters instead (token from "
                   "$REDRAFT_TOKEN)")
    s.add_argument("--no-verify", action="store_true",
                   help="skip checking the arrays' checksums (which reads the whole file)")
    s.set_defaults(func=cmd_stats)

    if command in COMMANDS:
        return
    try:
        from redraft.datastore.service import cli as service_cli
    except ModuleNotFoundError as exc:
        if exc.name not in ("redraft.datastore.service", "redraft.datastore.service.cli"):
            raise
    else:
        service_cli.register(sub)


def cmd_index(args: argparse.Namespace) -> int:
    from redraft.datastore.build import DEFAULT_SHARD_TOKENS, append_corpus, build_datastore

    progress = not args.quiet
    t0 = time.perf_counter()
    if args.delete is not None:
        if args.inputs or args.append:
            raise InvalidQuery("--delete takes no inputs and no --append")
        return _delete(args.out, set(_int_list(args.delete, "--delete")))
    common = dict(tokenizer=args.tokenizer, corpus=args.corpus, field=args.field,
                  exclude=args.exclude, skip_bad=args.skip_bad, progress=progress)
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
          f"in {m['n_shards']} shard(s), {time.perf_counter() - t0:.1f} s"
          + (f"; skipped {skipped:,} bad file(s) or record(s)" if skipped else ""))
    return 0


def _delete(out: str, ids: set[int]) -> int:
    from redraft.datastore.build import delete_documents
    from redraft.datastore.reader import Reader

    if not ids:
        raise InvalidQuery("--delete: no document ids given")
    with Reader(out) as r:
        before = len(r.deleted)
    m = delete_documents(out, ids)
    new = m["n_deleted"] - before
    already = f" ({len(ids) - new} already deleted)" if len(ids) > new else ""
    print(f"deleted {new} document(s){already} from {out}: {m['n_docs']:,} documents, "
          f"{m['n_tokens']:,} tokens live")
    return 0


def _int_list(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError as exc:
        raise InvalidQuery(f"{what}: expected comma-separated integers, got {text!r}") from exc


def _tokenizer_for(reader, name: str | None, required: bool):
    """The tokenizer matching the datastore, or None when not required and unavailable."""
    from redraft.datastore.tokenizer import load_tokenizer, tokenizer_fingerprint

    try:
        tok = load_tokenizer(name or reader.tokenizer_name)
        reader.check_tokenizer(tokenizer_fingerprint(tok))
        return tok
    except RedraftError:
        if required:
            raise
        return None


def cmd_query(args: argparse.Namespace) -> int:
    from redraft.datastore.reader import Reader

    if args.text is not None:
        what, context, empty = "--text", None, not args.text
    else:
        context = _int_list(args.tokens, "--tokens")
        what, empty = "--tokens", not context
    if empty:
        raise InvalidQuery(f"{what}: empty context")
    with Reader(args.datastore, verify=True) as r:
        tok = None
        if context is None:
            tok = _tokenizer_for(r, args.tokenizer, required=True)
            context = tok(args.text, add_special_tokens=False)["input_ids"]
        r.check_ids(context, what)  # every id, not only the tail a lookup reads
        d = r.propose(context, budget=args.budget, max_depth=args.max_depth,
                      max_match_len=args.max_match_len, min_match_len=args.min_match_len,
                      max_occurrences=args.max_occurrences, corpora=args.corpus)
        if tok is None:
            tok = _tokenizer_for(r, args.tokenizer, required=False)
    pieces = [tok.decode([t]) for t in d.tokens] if tok is not None else None
    if args.json:
        tree = {"tokens": d.tokens, "parents": d.parents, "probs": d.probs}
        out = {"match_len": d.match_len, "context_len": len(context), **tree, "tree": tree,
               "sources": d.sources, "expected_accepted": d.expected_accepted}
        if pieces is not None:
            out["pieces"] = pieces
        print(json.dumps(out))
        return 0
    print(f"match_len: {d.match_len}  nodes: {len(d)}  "
          f"expected accepted: {d.expected_accepted:.2f}")
    depth: list[int] = []
    for i, (t, p, pr) in enumerate(zip(d.tokens, d.parents, d.probs)):
        depth.append(0 if p < 0 else depth[p] + 1)
        label = repr(pieces[i]) if pieces is not None else str(t)
        print(f"{i:4d}  p={pr:.3f}  {'  ' * depth[i]}{label}  (id {t}, parent {p})")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from redraft.datastore.reader import Reader

    if args.server:
        from redraft.datastore.service.cli import print_server_stats

        return print_server_stats(args.server)
    if not args.datastore:
        raise RedraftError("stats needs a datastore DIR or --server ADDR")

    with Reader(args.datastore, verify=not args.no_verify) as r:
        size = os.path.getsize(r.file)
        m = dict(r.manifest)
        n = max(1, m["n_tokens"])
        m["path"] = os.path.abspath(args.datastore)
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
