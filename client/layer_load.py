"""A translation written into paged caches layer by layer, as its blocks arrive.

The sidecar sends a contiguous answer layer after layer. ``write_stream`` writes each block into its layer's pages as
it is decoded and tells a ``LayerLoad``, on which an engine's attention layer ``wait``s for its own layer only: the
first layers' attention runs while later layers are still on the wire. A load that fails (or ends without a layer)
releases every waiter; the caller reports the blocks for the engine to recompute.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

import torch

from kvferry.common.errors import InvalidInput
from kvferry.common.messages import Block

from .importers import write_pages


class LayerLoad:
    """One translation's arrival into ``layers`` target layers of ``tokens`` tokens each (the tokens the engine lacks).

    ``wait(layer)`` returns once that layer's tokens are all written, or once the load has ended without them: True
    in the first case. ``ready_at[layer]``: seconds from the load's start to that layer's last write."""

    def __init__(self, layers: int, tokens: int):
        if layers < 1 or tokens < 0:
            raise ValueError(f"a load needs layers >= 1 and tokens >= 0, got {layers} and {tokens}")
        self.t0 = time.perf_counter()
        self._left = [tokens] * layers
        self._ready = [threading.Event() for _ in range(layers)]
        self.ready_at: list[float | None] = [None] * layers
        self.done = threading.Event()
        self.error: BaseException | None = None
        if tokens == 0:
            for layer in range(layers):
                self._set(layer)

    @property
    def layers(self) -> int:
        return len(self._left)

    def _set(self, layer: int) -> None:
        self.ready_at[layer] = time.perf_counter() - self.t0
        self._ready[layer].set()
        time.sleep(0)  # hand the interpreter to a waiter now, not after the switch interval (5 ms) of decoding on

    def wrote(self, layer: int, tokens: int) -> None:
        """``tokens`` more tokens of ``layer`` are in their pages."""
        before = self._left[layer]
        self._left[layer] -= tokens
        if before > 0 >= self._left[layer]:
            self._set(layer)

    def complete(self) -> None:
        """The answer has ended: every layer must be whole (else InvalidInput, and the load has failed)."""
        missing = [layer for layer, left in enumerate(self._left) if left > 0]
        if missing:
            raise InvalidInput(f"the translation ended without all of target layers {missing}")
        self.done.set()

    def fail(self, error: BaseException) -> None:
        """The load stopped: release every waiter."""
        self.error = error
        for e in self._ready:
            e.set()
        self.done.set()

    def wait(self, layer: int, timeout: float | None = None) -> bool:
        """Block until ``layer`` is in its pages (True) or the load has failed without it (False; False too after
        ``timeout``). A layer can be whole in a load that failed later: the caller reports the failed load anyway."""
        self._ready[layer].wait(timeout)
        return self._left[layer] <= 0


def write_stream(
    blocks: Iterable[Block],
    views: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    table: torch.Tensor,
    start: int,
    load: LayerLoad,
) -> None:
    """Write contiguous blocks (any token ranges, layer after layer) into paged caches as they arrive: ``views(layer)``
    gives that layer's K and V pages ([pages, kv_heads, page_size, head_dim], see ``write_pages``), ``table`` the
    request's pages in order, tokens before ``start`` are skipped. ``load`` hears of each write; any failure fails it
    (its waiters are released) and is raised."""
    try:
        for b in blocks:
            if not 0 <= b.layer < load.layers:
                raise InvalidInput(f"the translation sent target layer {b.layer}; the engine has {load.layers} layers")
            write_pages(b, *views(b.layer), table, start)
            load.wrote(b.layer, max(0, b.end - max(b.start, start)))
        load.complete()
    except BaseException as e:
        load.fail(e)
        raise
