"""The engine: the KV arena, the compiled steps and attentions, per-lane sampling, the `Engine` that owns them on the
device, the prefix cache, the host-only scheduler thread that fills, runs and retires lanes, and its metrics."""
