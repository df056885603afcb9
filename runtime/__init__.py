"""The pie-ctx runtime: KV pages (kv/), models (model/), scheduling (engine/), server (server/)."""

# Batch-invariant numerics unless told otherwise: THE line that sets the default of
# boot_engine(deterministic=), Runtime.local and run/serve's --deterministic
# (docs/performance.md "Deterministic numerics" says what it costs and why it is on).
DETERMINISTIC = True
