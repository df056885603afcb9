"""Tests of runtime.kv: unit, oracle (dense reference), state machine and KV content."""
