"""Refusing a request: a status code with a message that says what was wrong, and request
parsing that lets undecodable bytes reach the handler to be refused as INVALID_ARGUMENT.

Tested by: tests/datastore/service/test_wire.py, tests/datastore/service/test_server.py"""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError


class Refusal(Exception):
    """A request the service refuses: carries the status code and the message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def bad(message: str) -> Refusal:
    return Refusal(grpc.StatusCode.INVALID_ARGUMENT, message)


class Malformed:
    """Stands for a request whose bytes do not parse, so the handler can refuse it with
    INVALID_ARGUMENT (gRPC itself would end the call with UNKNOWN)."""

    def __init__(self, what: str, error: Exception) -> None:
        self.message = f"malformed {what}: {error}"


def lenient(message_type):
    """A request deserializer that returns `Malformed` instead of raising."""

    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except DecodeError as exc:
            return Malformed(message_type.DESCRIPTOR.name, exc)

    return parse


def over_context(noun: str, n: int, limit: int) -> Refusal:
    """A prompt or context of `n` tokens, past max_context_len `limit`: the server's refusal,
    and what the batch tracker says of an open it does not send because of it."""
    return Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                   f"{noun} of {n} tokens exceeds max_context_len {limit}")


def check_parsed(request) -> None:
    if isinstance(request, Malformed):
        raise bad(request.message)
