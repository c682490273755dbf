"""The gRPC draft service, one module per job:

- `handlers`: the Drafter servicer, each RPC from the wire to drafting and back;
- `validation`, `refusals`: what a request may ask for, and how a bad one is refused;
- `session_limits`: streaming sessions within their limits, the idle sweeper;
- `batch_rpc`: the batched RPC, an engine's sequences held between calls;
- `tenants`: the keys learned outputs are kept, logged and persisted under;
- `learned_outputs`: the learned outputs all sessions share; `sharing`: with the other processes
  serving the datastore; `persisting`: into the datastore, exactly once;
- `reload`: following the datastore's new commits; `integrity`: its checksums, in the
  background;
- `config`: the server's limits; `server`: its assembly (TLS, health, shutdown, threads);
  `stats`: counters shared by worker processes; `serve_cli`: `redraft serve`; `spawn`:
  `redraft serve` as a child process, for the tests and the tools;
- `wire`: the messages to redraft's values and back, both directions, for the client and the
  server alike;
- `client` (the connection, streaming sessions) and `batch_client` (an engine's batched
  calls): what a decoder or an engine uses; `client_errors`: their typed errors;
  `credentials`: the tokens and TLS roots a client presents.

Drafting itself lives outside this package, in `redraft.datastore.drafting`, so that the
service and the decoder's in-process drafting run the same code.
"""
