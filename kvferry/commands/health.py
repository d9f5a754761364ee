"""`kvferry health`: a sidecar's gRPC health service (exit 0 when SERVING)."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    h = sub.add_parser("health", help="check a sidecar's gRPC health service (exit 0 when SERVING)")
    h.add_argument("--address", default="127.0.0.1:50551")
    h.add_argument("--service", default="kvferry.v1.TranslateService", help='"" for the server as a whole')
    h.add_argument("--timeout", type=float, default=5.0)
    h.add_argument("--tls-ca", default="")
    h.add_argument("--tls-cert", default="")
    h.add_argument("--tls-key", default="")
    h.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    import grpc

    from kvferry.client.health import check

    try:
        status = check(a.address, a.service, a.timeout, a.tls_ca, a.tls_cert, a.tls_key)
    except grpc.RpcError as e:
        print(f"{a.address} {a.service or '(server)'}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print(f"{a.address} {a.service or '(server)'}: {status}")
    return 0 if status == "SERVING" else 1
