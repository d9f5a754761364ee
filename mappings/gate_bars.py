"""The serving gates' default bars: one home, read by ``Gates`` and by the sidecar's configuration (whose flags
``kvferry --help`` builds without importing torch, so this module imports nothing)."""

GATE_ARM = "mapped_refresh"
"""The evaluated arm the gates read: the path serving takes (the target's prefill of the last r tokens on the map)."""
MIN_TOP10 = 0.8
"""Next-token top-10 overlap with the target's full prefill, at least."""
MAX_KL = float("inf")
"""Mean KL(full prefill || mapped), at most (off by default)."""
MIN_COPY_RETENTION = 0.85
"""Share of the target's own copy-probe accuracy kept at every gap, at least."""
MAX_COMPLETION_DROP = 0.02
"""How far below the target's own downstream score the served arm may fall."""
MARGINAL = "refuse"
"""What a measure whose bar lies inside its 95% interval does: "refuse" or "serve"."""
