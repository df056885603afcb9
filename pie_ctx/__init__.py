"""pie-ctx: write inferlets, async programs that steer an LLM's KV cache directly.

Importing this package never imports torch: the SDK talks to the runtime through one
narrow transport interface.
"""

from __future__ import annotations

from pie_ctx import errors

__all__ = ["errors"]
__version__ = "0.1.0"
