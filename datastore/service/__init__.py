"""The gRPC draft service: `server` (the Drafter service and its assembly), `client` (what a
decoder uses), `stats` (counters shared by worker processes), `cli` (`redraft serve`).

Drafting itself lives outside this package, in `redraft.datastore.session`, so that the
service and the decoder's in-process drafting run the same code.
"""
