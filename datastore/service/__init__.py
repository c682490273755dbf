"""The gRPC draft service, one module per job:

- `handlers`: the Drafter servicer, each RPC from the wire to drafting and back;
- `validation`, `refusals`: what a request may ask for, and how a bad one is refused;
- `sessions`: streaming sessions within their limit, the idle sweeper;
- `learning`: the learned outputs all sessions share, reloaded and persisted;
- `verification`: the datastore's checksums, checked in the background;
- `config`: the server's limits; `server`: its assembly (TLS, health, shutdown, threads);
- `client`: what a decoder uses; `stats`: counters shared by worker processes;
- `serve_cli`: `redraft serve`.

Drafting itself lives outside this package, in `redraft.datastore.drafting`, so that the
service and the decoder's in-process drafting run the same code.
"""
