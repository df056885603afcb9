"""Runner failures the engine treats differently from a failed step.

A step that raises is normally bisected down to the row that causes it (``Engine``); a
runner that can never step again raises :class:`RunnerLost` instead, and the engine fails
every pending request with it and takes no more work.
"""

from __future__ import annotations

from pie_ctx.proto.errors import ModelError

__all__ = ["RunnerLost"]


class RunnerLost(ModelError):
    """The runner can never run a step again (a tensor-parallel rank died or hung; see
    ``runtime.distributed``): restart the engine. Clients see a ``ModelError``."""
