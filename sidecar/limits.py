"""Per-request limits, checked against the header before anything is allocated."""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.mappings.errors import InvalidInput, TooLarge


@dataclass(frozen=True)
class Limits:
    """Bounds on one Translate request."""

    max_tokens: int = 131072
    """Most tokens one request may translate."""
    max_request_bytes: int = 2 << 30
    """Most source KV bytes one request may declare (all layers, K and V)."""
    max_block_size: int = 4096
    """Largest paged block size accepted."""
    max_message_bytes: int = 64 << 20
    """Largest gRPC message the sidecar sends: contiguous blocks are cut to fit it; a page that cannot is refused."""

    # Room left in each response message for the block's framing (ids, shapes, dtype, protobuf tags).
    MESSAGE_OVERHEAD = 1024

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.max_request_bytes < 1 or self.max_block_size < 1:
            raise InvalidInput("limits must be positive")
        if not 2 * self.MESSAGE_OVERHEAD <= self.max_message_bytes <= 2**31 - 1:
            raise InvalidInput(f"max_message_bytes must be in [{2 * self.MESSAGE_OVERHEAD}, {2**31 - 1}] (gRPC's limit "
                               f"is a signed 32-bit size); got {self.max_message_bytes}")

    def tokens_per_message(self, bytes_per_token: int) -> int:
        """How many tokens of a block fit one response message (0: not even one)."""
        return (self.max_message_bytes - self.MESSAGE_OVERHEAD) // bytes_per_token

    def check(self, tokens: int, declared_bytes: int) -> None:
        if tokens > self.max_tokens:
            raise TooLarge(f"request declares {tokens} tokens; this sidecar allows at most {self.max_tokens} per request. "
                           "Split the prompt or raise --max-tokens.")
        if declared_bytes > self.max_request_bytes:
            raise TooLarge(f"request declares {declared_bytes} bytes of source KV; the limit is {self.max_request_bytes}. "
                           "Send fewer tokens per request or raise --max-request-bytes.")
