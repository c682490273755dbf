"""The few typed errors a client of the draft service raises, and the gRPC status each
stands for: a decoder tells "fall back to local drafting" (unreachable, timed out) from "fix
the request" (invalid, wrong tokenizer) by type alone. Shared by the connection (`client`),
the batch tracker (`batch_client`) and the wire conversion (`wire`), which turns a batched
entry's status code into one of them.

Tested by: tests/datastore/service/test_wire.py, tests/datastore/service/test_client.py"""

from __future__ import annotations

import grpc
from redraft.proto.errors import InvalidQuery, RedraftError, TokenizerMismatch


class ServiceError(RedraftError):
    """The draft service refused or failed a call; `code` is the gRPC status code and
    `details` the server's own message (the error's text adds the address and the code)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None,
                 details: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.details = message if details is None else details


class ServiceUnavailable(ServiceError):
    """The server cannot be reached, went away, or is shutting down."""


class DraftTimeout(ServiceError):
    """A call or a session step ran past its deadline."""


class InvalidRequest(ServiceError, InvalidQuery):
    """The server rejected the request's content (token ids, budget, corpora, ...)."""


class IncompatibleTokenizer(ServiceError, TokenizerMismatch):
    """The datastore was built with another tokenizer than the caller's."""


class LimitExceeded(ServiceError):
    """A server limit was hit: sessions, context length, message size, idle timeout."""


class AuthenticationFailed(ServiceError):
    """Missing or wrong token."""


class UnknownSequence(ServiceError):
    """A batched entry named a sequence the server does not hold (never opened, closed,
    swept after idling, or the server restarted): open it again with its whole context."""


_ERRORS: dict[grpc.StatusCode, type[ServiceError]] = {
    grpc.StatusCode.NOT_FOUND: UnknownSequence,
    grpc.StatusCode.UNAVAILABLE: ServiceUnavailable,
    grpc.StatusCode.CANCELLED: ServiceUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DraftTimeout,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.FAILED_PRECONDITION: IncompatibleTokenizer,
    grpc.StatusCode.RESOURCE_EXHAUSTED: LimitExceeded,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationFailed,
}

STATUS = {c.value[0]: c for c in grpc.StatusCode}  # wire value -> StatusCode


def typed(exc: grpc.RpcError, address: str) -> ServiceError:
    """A failed call as the typed error of its status."""
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return error_for(code, details, address)


def error_for(code: grpc.StatusCode | None, details: str, address: str) -> ServiceError:
    """The typed error of status `code` with the server's `details`, from `address`."""
    cls = _ERRORS.get(code, ServiceError)
    name = code.name if code is not None else "ERROR"
    return cls(f"draft service {address}: {name}: {details}", code, details)
