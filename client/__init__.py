"""kvferry's client: translate a source model's cache through a sidecar, import it into the target, run the cascade.

    from kvferry.client import TranslateClient, ClientOptions, Cascade, to_dynamic_cache

Names are imported on first use (``import kvferry.client`` alone loads neither torch nor grpc).
"""

from __future__ import annotations

from kvferry.lazy import lazy_exports

_EXPORTS = {
    "ClientOptions": "client",
    "Retry": "client",
    "Tls": "client",
    "SharedMemory": "client",
    "Request": "client",
    "TranslateClient": "client",
    "AsyncTranslateClient": "client",
    "TranslateResult": "client",
    "TranslateStream": "client",
    "AsyncTranslateStream": "client",
    "make_spec": "client",
    "MappingInfo": "client",
    "serving_mapping": "client",
    "Cascade": "cascade",
    "CascadeResult": "cascade",
    "to_dynamic_cache": "importers",
    "PagedKVPool": "importers",
    "write_pages": "importers",
    "MapRollout": "rollout",
    "RolloutPolicy": "rollout",
    "PolicyStore": "rollout",
    "update_policy_file": "rollout",
    "QualityMonitor": "monitor",
    "Thresholds": "monitor",
    "DirectReader": "direct",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
