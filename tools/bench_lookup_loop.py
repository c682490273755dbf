"""Lookup time in a warm loop: one datastore's `Reader`, the same contexts passed again and
again, so what is timed is the lookup code, not first-touch paging of a fresh store.

`make bench-datastore` times one pass over a store it has just built and opened; this one
opens an existing store (e.g. the `stdlib` store that command leaves in bench-out/datastore)
and times `longest_match` and `propose` over contexts cut from the same held-out standard
library files, after a warm-up, several passes, mean per call of each pass:

    .venv/bin/python -m tools.bench_lookup_loop bench-out/datastore/stdlib [--passes 3]
"""

from __future__ import annotations

import argparse
import time

from redraft.datastore import Reader
from redraft.datastore.drafting import retrieval_tree
from redraft.proto.models import DEFAULT_MODEL, load_tokenizer

from tools.bench_datastore import contexts, stdlib_files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("datastore")
    ap.add_argument("--contexts", type=int, default=600)
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()
    tok = load_tokenizer(DEFAULT_MODEL)
    _, held = stdlib_files()
    ctxs = [c for c, _ in contexts([tok.encode(p.read_text()) for p in held], args.contexts)]
    with Reader(args.datastore) as r:
        for c in ctxs[:100]:
            retrieval_tree(r, c, budget=64)
        for k in range(args.passes):
            t0 = time.perf_counter()
            for c in ctxs:
                r.longest_match(c, max_len=16, min_len=2)
            t1 = time.perf_counter()
            for c in ctxs:
                retrieval_tree(r, c, budget=64)
            t2 = time.perf_counter()
            print(f"pass {k + 1}: longest match {(t1 - t0) / len(ctxs) * 1e6:.0f} us, "
                  f"propose (budget 64) {(t2 - t1) / len(ctxs) * 1e6:.0f} us per call")


if __name__ == "__main__":
    main()
