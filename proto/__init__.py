"""Generated gRPC stubs for proto/draft.proto (package redraft.v1).

Regenerate with `make proto`; the stubs are committed so installing needs no protoc.
"""

from redraft.proto import draft_pb2, draft_pb2_grpc

__all__ = ["draft_pb2", "draft_pb2_grpc"]
