"""The pie-ctx runtime: KV pages (kv/), models (model/), scheduling (engine/), server (server/)."""
