"""The gRPC channel settings that the sidecar's server and every client share."""

from __future__ import annotations

MAX_MESSAGE_BYTES = 64 << 20
"""Default largest gRPC message, sent or received (gRPC's own 4 MiB default is too small for KV chunks)."""


def message_size_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """The channel (or server) arguments that raise gRPC's message-size limits, both ways, to ``max_message_bytes``."""
    return [("grpc.max_receive_message_length", max_message_bytes), ("grpc.max_send_message_length", max_message_bytes)]
