"""Per-request limits, checked against the header before anything is allocated."""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.common.errors import InvalidInput, TooLarge
from kvferry.common.fastwire import REQUEST_HEADER_TAG, ChunkFrame


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
            raise InvalidInput(
                f"max_message_bytes must be in [{2 * self.MESSAGE_OVERHEAD}, {2**31 - 1}] (gRPC's limit "
                f"is a signed 32-bit size); got {self.max_message_bytes}"
            )

    # Header bytes beyond its token_ids (identifiers are at most 256 characters each, fingerprints, small fields).
    HEADER_FIXED_BYTES = 64 << 10

    @property
    def max_header_bytes(self) -> int:
        """Largest serialized header a request within max_tokens can need: ten bytes per token id (the widest
        varint) plus the fixed fields. A bigger one is refused before it is parsed."""
        return 10 * self.max_tokens + self.HEADER_FIXED_BYTES

    def tokens_per_message(self, bytes_per_token: int) -> int:
        """How many tokens of a block fit one response message (0: not even one)."""
        return (self.max_message_bytes - self.MESSAGE_OVERHEAD) // bytes_per_token

    def check(self, tokens: int, declared_bytes: int) -> None:
        if tokens > self.max_tokens:
            raise TooLarge(
                f"request declares {tokens} tokens; this sidecar allows at most {self.max_tokens} per request. "
                "Split the prompt or raise --max-tokens."
            )
        if declared_bytes > self.max_request_bytes:
            raise TooLarge(
                f"request declares {declared_bytes} bytes of source KV; the limit is {self.max_request_bytes}. "
                "Send fewer tokens per request or raise --max-request-bytes."
            )


@dataclass(frozen=True)
class OversizedHeader:
    """What the request decoder yields in place of a header too large to be one this sidecar could accept: it is
    refused (RESOURCE_EXHAUSTED) without ever being parsed (8M token_ids parse to hundreds of MB)."""

    size: int
    limit: int

    def refuse(self) -> TooLarge:
        from .memory import release_freed

        release_freed()  # the header's bytes were freed at once: give them back (see memory.py)
        return TooLarge(
            f"a {self.size}-byte header is larger than any request within --max-tokens needs "
            f"({self.limit} bytes); send one token id per token, or raise --max-tokens"
        )


@dataclass(frozen=True)
class UndecodableRequest:
    """What TranslateByKey's decoder yields for bytes that are no TranslateByKeyRequest: refused as INVALID_ARGUMENT by
    the handler (a deserializer that raised would leave the status to gRPC)."""

    reason: str

    def refuse(self) -> InvalidInput:
        return InvalidInput(
            f"the TranslateByKey request is not a kvferry.v1.TranslateByKeyRequest ({self.reason}); "
            "serialize that message, with the key-only header in field 1"
        )


def by_key_decoder(limits: Limits, parse):
    """TranslateByKey's request deserializer: ``parse`` (TranslateByKeyRequest.FromString), except that a request
    over ``limits.max_header_bytes`` becomes an OversizedHeader, never parsed, and bytes ``parse`` refuses become
    an UndecodableRequest."""
    cap = limits.max_header_bytes

    def decode(data: bytes):
        if len(data) > cap:
            return OversizedHeader(len(data), cap)
        try:
            return parse(data)
        except Exception as e:  # protobuf's DecodeError, or whatever a parser raises on hostile bytes
            return UndecodableRequest(type(e).__name__)

    return decode


def request_decoder(limits: Limits, parse):
    """Translate's request deserializer: ``parse`` (wire.decode_request: chunks as ChunkFrames, read in place, other
    messages as TranslateRequests), except that a header over
    ``limits.max_header_bytes`` becomes an OversizedHeader: unparsed when it leads with the header's tag (every
    serializer's output), and dropped right after parsing when a crafted message hides it behind other fields."""
    cap = limits.max_header_bytes

    def decode(data: bytes):
        if len(data) > cap and data[:1] == REQUEST_HEADER_TAG:
            return OversizedHeader(len(data), cap)
        msg = parse(data)
        if len(data) > cap and not isinstance(msg, ChunkFrame) and msg.WhichOneof("msg") == "header":
            return OversizedHeader(len(data), cap)
        return msg

    return decode
