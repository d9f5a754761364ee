"""kvferry's offline lab: capture, closed-form fits (ridge, Gram sums, reduced rank), distillation, values matched to
attention, the evaluation and its probes, references, the frontier. Serving never imports it (import-linter holds
that): the runtime is the rest of kvferry.mappings (artifact, apply, cache, rope, features, geometry, precision,
versions, gates, drift)."""
