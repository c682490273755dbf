"""The contract both halves build on, and the small shared base.

- `draft.proto` and its generated stubs (`draft_pb2`, `draft_pb2_grpc`; regenerate with
  `make proto`, they are committed so installing needs no protoc): the wire;
- `tree`: the candidate-tree type `Tree` and the tree operations;
- `errors`: `RedraftError` and the typed errors both halves raise;
- `models`: what a model name means (resolution, tokenizers and their fingerprint);
- `files`: the cache root and atomic file replacement.

Importing any of these never imports torch; only the stubs import gRPC, so this `__init__`
imports none of them.
"""
