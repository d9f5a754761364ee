"""Run a sidecar on a background event loop thread (demo, benchmarks, tests)."""

from __future__ import annotations

import asyncio
import threading

from .config import SidecarConfig
from .server import Sidecar


class BackgroundSidecar:
    """A real grpc.aio sidecar on its own loop thread; ``address`` is host:port."""

    def __init__(self, config: SidecarConfig):
        self.sidecar = Sidecar(config)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kvferry-sidecar", daemon=True)
        self.thread.start()
        self.port = self.call(self.sidecar.start())
        self.address = f"{config.host}:{self.port}"

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, grace: float = 1.0) -> None:
        if not self.loop.is_running():
            return
        self.call(self.sidecar.drain(grace))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
