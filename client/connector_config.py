"""The vLLM connector's settings (``kv_connector_extra_config``), typed and validated once.

Kept apart from :mod:`kvferry.client.vllm_connector` so it can be checked without vLLM installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvferry.common.errors import InvalidInput
from kvferry.common.files import read_secret_text
from kvferry.common.settings import check_range, read_settings
from kvferry.common.stores import STORE_SCHEMES
from kvferry.common.urls import check_store_url

from .rollout import MapRollout


@dataclass(frozen=True)
class ConnectorConfig:
    """``kv_connector_extra_config``, typed and validated once."""

    redis_url: str = ""
    """The prefix store both engines share (redis:// or rediss://)."""
    prefix_secret: str = ""
    """HMAC key of block hashes; the sidecar's prefix_secret (or use prefix_secret_file)."""
    prefix_secret_file: str = ""
    """File holding the prefix secret."""
    prefix_block_size: int = 256
    """Tokens per prefix block: the sidecar's prefix_block_size, a multiple of vLLM's block size."""
    tenant: str = "default"
    """Prefix-store namespace (with sidecar auth, the token's tenant)."""
    sidecar: str = ""
    """Consumer: host:port of the kvferry sidecar."""
    map_name: str = ""
    """Consumer: the map to use, <source>__<target>."""
    map_version: str = ""
    """Consumer: exact version, or "" for the newest servable one (resolved once, then pinned: see rollout.py)."""
    min_tokens: int = MapRollout.min_tokens
    """Consumer: shorter prompts are left to vLLM's own prefill."""
    refresh: int = MapRollout.refresh
    """Consumer: the target recomputes at least the last ``refresh`` prompt tokens itself."""
    policy_file: str = ""
    """Consumer: the rollout policy file (see kvferry.client.rollout): kill switch, canary share, version pin,
    min_tokens and refresh for map_name, re-read when it changes. Empty: the fields above apply as they are."""
    policy_reload_seconds: float = 1.0
    """Consumer: how often, at most, the policy file is checked for a change (0: on every request, a stat each)."""
    auth_token: str = ""
    """Consumer: bearer token for the sidecar (vLLM logs its connector settings at start: prefer auth_token_file)."""
    auth_token_file: str = ""
    """Consumer: file holding the bearer token (instead of auth_token)."""
    timeout: float = 30.0
    """Consumer: deadline of one translation, seconds."""
    status_seconds: float = 5.0
    """Consumer: how long the scheduler trusts its last look at the map's status."""
    shm_dir: str = ""
    """Consumer: the folder this engine shares with its sidecar (the chart's sharedMemory.mountPath, also in
    KVFERRY_SHM_DIR there): translations then come back through files there instead of gRPC messages (see
    ClientOptions.shm_dir). Empty: through the messages."""
    async_loads: bool = True
    """Consumer: a request whose prefix is published waits for its translation off the engine's step (vLLM's
    asynchronous KV loads: the engine keeps stepping other requests while it arrives); false loads it inside the
    step that first schedules the request, which delays that step (see layer_by_layer)."""
    layer_by_layer: bool = False
    """Consumer, with async_loads false: the step's forward starts before the translation has arrived and each
    attention layer waits for its own layer's pages only (vLLM's wait_for_layer_load), so the first layers' attention
    overlaps the arrival of later ones. Off by default: on a CPU engine the forward and the load share the cores, and
    `kvferry bench vllm` finds no reliable gain there (docs/benchmarks.md, its vLLM section); it is meant for engines
    whose forward runs elsewhere (a GPU). False: the whole translation is in the pages before the forward starts."""
    direct_reads: bool = False
    """Consumer: read a translation whose mapped blocks are all stored straight from the prefix store, without the
    sidecar hop (kvferry.client.direct; the sidecar is still asked on a miss and for the map's status). No sidecar
    checks the tenant on that path: the store's credentials and the prefix secret, which this engine holds anyway,
    are the boundary."""

    def __post_init__(self) -> None:
        if not self.redis_url.startswith(STORE_SCHEMES):
            raise InvalidInput(
                f"kvferry connector: redis_url ({', '.join(STORE_SCHEMES)}) is required: the engines share "
                "the prefix store"
            )
        try:
            check_store_url(self.redis_url)
        except ValueError as e:
            raise InvalidInput(f"kvferry connector: redis_url: {e}") from None
        if not (self.prefix_secret or self.prefix_secret_file):
            raise InvalidInput("kvferry connector: prefix_secret (or prefix_secret_file) is required")
        if self.auth_token and self.auth_token_file:
            raise InvalidInput("kvferry connector: give auth_token or auth_token_file, not both")
        if self.prefix_block_size < 1:
            raise InvalidInput("kvferry connector: prefix_block_size must be >= 1")
        try:
            MapRollout(min_tokens=self.min_tokens, refresh=self.refresh)  # the one check of min_tokens and refresh
        except InvalidInput as e:
            raise InvalidInput(f"kvferry connector: {e}") from None
        try:
            check_range("timeout", self.timeout, 0, 3600, low_open=True)
            check_range("status_seconds", self.status_seconds, 0, 3600)
            check_range("policy_reload_seconds", self.policy_reload_seconds, 0, 3600)
        except InvalidInput as e:
            raise InvalidInput(f"kvferry connector: {e}") from None

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorConfig:
        try:
            typed = read_settings(cls, extra, "kv_connector_extra_config keys")
        except InvalidInput as e:
            raise InvalidInput(f"kvferry connector: {e}") from None
        return cls(**typed)

    def token(self) -> str:
        """The sidecar's bearer token ("" without one)."""
        return read_secret_text(self.auth_token_file, "auth_token_file") if self.auth_token_file else self.auth_token

    def secret(self) -> bytes:
        return (
            read_secret_text(self.prefix_secret_file, "prefix_secret_file")
            if self.prefix_secret_file
            else self.prefix_secret
        ).encode()
