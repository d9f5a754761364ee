"""A gRPC health check against a sidecar (the Helm test pod and exec probes use it)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .tls import tls_credentials


def check(
    address: str, service: str = "", timeout: float = 5.0, tls_ca: str = "", tls_cert: str = "", tls_key: str = ""
) -> str:
    """The serving status name of ``service`` at ``address`` (raises grpc.RpcError when unreachable)."""
    if tls_ca:
        channel = grpc.secure_channel(address, tls_credentials(tls_ca, tls_key, tls_cert))
    else:
        channel = grpc.insecure_channel(address)
    with channel:
        resp = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
