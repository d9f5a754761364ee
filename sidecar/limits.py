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

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.max_request_bytes < 1 or self.max_block_size < 1:
            raise InvalidInput("limits must be positive")

    def check(self, tokens: int, declared_bytes: int) -> None:
        if tokens > self.max_tokens:
            raise TooLarge(f"request declares {tokens} tokens; this sidecar allows at most {self.max_tokens} per request. "
                           "Split the prompt or raise --max-tokens.")
        if declared_bytes > self.max_request_bytes:
            raise TooLarge(f"request declares {declared_bytes} bytes of source KV; the limit is {self.max_request_bytes}. "
                           "Send fewer tokens per request or raise --max-request-bytes.")
