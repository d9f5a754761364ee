"""kvferry's gRPC sidecar: ``kvferry serve``, or in a program:

    from kvferry.sidecar import SidecarConfig, BackgroundSidecar
    with BackgroundSidecar(SidecarConfig(maps_dir="maps", port=0)) as sc: ...

Names are imported on first use.
"""

from __future__ import annotations

from kvferry.lazy import lazy_exports

_EXPORTS = {"SidecarConfig": "config", "Sidecar": "server", "serve": "server", "BackgroundSidecar": "background"}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
