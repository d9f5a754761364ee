"""Prometheus metrics of one sidecar (its own registry, so tests can run several servers)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvferry_requests_total", "RPCs finished, by method and status code", ["method", "code"], registry=r
        )
        self.latency = Histogram(
            "kvferry_request_seconds",
            "RPC wall time",
            ["method"],
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.tokens = Counter("kvferry_tokens_total", "Tokens translated", ["map"], registry=r)
        self.bytes_in = Counter("kvferry_bytes_in_total", "Source KV bytes received", ["map"], registry=r)
        self.bytes_out = Counter("kvferry_bytes_out_total", "Target KV bytes sent", ["map"], registry=r)
        self.compute = Histogram(
            "kvferry_compute_seconds",
            "Map compute per request",
            ["map"],
            registry=r,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
        )
        self.streams = Gauge("kvferry_active_streams", "Translate streams in flight", registry=r)
        self.maps_servable = Gauge("kvferry_maps_servable", "Loaded map versions that pass the gates", registry=r)
        self.map_quality = Gauge(
            "kvferry_map_quality",
            "Evidence of each loaded map version (the arm the gates read)",
            ["map", "version", "metric"],
            registry=r,
        )
        self.map_events = Counter("kvferry_map_events_total", "Registry events", ["event"], registry=r)
        self.prefix_blocks = Counter(
            "kvferry_prefix_blocks_total", "Prefix-store block lookups by outcome", ["outcome"], registry=r
        )
        self.prefix_writes = Counter(
            "kvferry_prefix_writes_total", "Mapped blocks written to the prefix store", registry=r
        )
        self.prefix_store_errors = Counter(
            "kvferry_prefix_store_errors_total", "Prefix-store calls that failed", registry=r
        )
        self.prefix_store_open = Gauge(
            "kvferry_prefix_store_open",
            "1 while the prefix store is not called after a failure (its circuit breaker is open)",
            registry=r,
        )
        self.response_regions = Counter(
            "kvferry_response_regions_total",
            "Response regions callers named, by outcome "
            "(taken; ignored: not openable, or the sidecar has no shm_dir; refused: its header lacks the call's key)",
            ["outcome"],
            registry=r,
        )

    def record_maps(self, entries, arm_name: str) -> None:
        """Servable count, and each map's evidence for the arm the gates read (as ListMappings reports it)."""
        self.maps_servable.set(sum(e.servable for e in entries))
        for e in entries:
            arm = (e.maps.evidence or {}).get("arms", {}).get(arm_name, {})
            for metric in ("top1", "top10", "kl", "attn_cos"):
                if metric in arm:
                    self.map_quality.labels(e.maps.name, e.maps.version, metric).set(arm[metric])

    def serve(self, host: str, port: int) -> int:
        """Start /metrics on a side port; returns the bound port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_address[1]
