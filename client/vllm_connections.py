"""The sidecar client and the prefix store of one side of the vLLM connector, each made at first use."""

from __future__ import annotations

from functools import cached_property


class Connections:
    """``client``: a TranslateClient factory; ``store``: the prefix store's factory. Neither is called before the
    side first needs it (a producer never asks the sidecar; a consumer's workers may never publish)."""

    def __init__(self, client, store):
        self._make_client, self._make_store = client, store

    @cached_property
    def client(self):
        return self._make_client()

    @cached_property
    def store(self):
        return self._make_store()

    def close(self) -> None:
        if "client" in self.__dict__:  # made
            self.client.close()
