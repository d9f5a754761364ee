"""A client's TLS credentials from the PEM files an operator names: one reader for every client (the translation
clients and the health check), each file a bounded regular file (kvferry.common.files)."""

from __future__ import annotations

import grpc

from kvferry.common.files import PEM_LIMIT, read_small_file


def tls_credentials(root_certs: str, client_key: str = "", client_cert: str = "") -> grpc.ChannelCredentials:
    """Channel credentials trusting ``root_certs``, presenting ``client_cert`` / ``client_key`` (mutual TLS) when
    given."""

    def read(path, what):
        return read_small_file(path, what, PEM_LIMIT) if path else None

    return grpc.ssl_channel_credentials(
        read(root_certs, "the TLS CA bundle"),
        read(client_key, "the TLS client key"),
        read(client_cert, "the TLS client certificate"),
    )
