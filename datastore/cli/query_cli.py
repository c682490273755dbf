"""`redraft query`: look up a context and print the retrieval tree.

Tested by: tests/datastore/cli/test_datastore_cli.py"""

from __future__ import annotations

import argparse
import json

from redraft.datastore.cli.index_cli import int_list
from redraft.datastore.drafting import retrieval_tree
from redraft.datastore.reader import Reader
from redraft.proto.errors import InvalidQuery, RedraftError
from redraft.proto.models import load_tokenizer, tokenizer_fingerprint
from redraft.proto.tree import DEFAULT_BUDGET, DEFAULT_MAX_DEPTH


def register(sub: argparse._SubParsersAction) -> None:
    q = sub.add_parser("query", help="look up a context and print the candidate tree")
    q.add_argument("--datastore", required=True, metavar="DIR")
    src = q.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="context text (tokenized with the datastore's tokenizer)")
    src.add_argument("--tokens", help="context token ids, comma-separated")
    q.add_argument("--json", action="store_true", help="print one JSON object")
    q.add_argument("--budget", type=int, default=DEFAULT_BUDGET,
                   help=f"maximum tree nodes (default {DEFAULT_BUDGET})")
    q.add_argument("--max-depth", type=int, default=DEFAULT_MAX_DEPTH)
    q.add_argument("--max-match-len", type=int, default=16)
    q.add_argument("--min-match-len", type=int, default=2)
    q.add_argument("--max-occurrences", type=int, default=256)
    q.add_argument("--corpus", action="append", default=None, metavar="NAME",
                   help="restrict to this corpus (repeatable)")
    q.add_argument("--tokenizer", metavar="MODEL", default=None,
                   help="tokenizer for --text (default: the one the datastore was built with)")
    q.set_defaults(func=cmd_query)


def _tokenizer_for(reader, name: str | None, required: bool):
    """The tokenizer matching the datastore, or None when not required and unavailable."""
    try:
        tok = load_tokenizer(name or reader.tokenizer_name)
        reader.check_tokenizer(tokenizer_fingerprint(tok))
        return tok
    except RedraftError:
        if required:
            raise
        return None


def cmd_query(args: argparse.Namespace) -> int:
    if args.text is not None:
        what, context, empty = "--text", None, not args.text
    else:
        context = int_list(args.tokens, "--tokens")
        what, empty = "--tokens", not context
    if empty:
        raise InvalidQuery(f"{what}: empty context")
    with Reader(args.datastore, verify=True) as r:
        tok = None
        if context is None:
            tok = _tokenizer_for(r, args.tokenizer, required=True)
            context = tok(args.text, add_special_tokens=False)["input_ids"]
        r.check_ids(context, what)  # every id, not only the tail a lookup reads
        d = retrieval_tree(r, context, budget=args.budget, max_depth=args.max_depth,
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
