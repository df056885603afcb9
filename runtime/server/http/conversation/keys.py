"""The key scope: whose a key-scoped resource is.

Owner: :func:`key_scope`, the one name of a caller's API key that every key-scoped
resource uses: the snapshot namespace of ``/v1/responses``' stored responses
(``responses.store``) and the fleet's sessions (``runtime.fleet.sessions``: a session a
client names is its key's). It is a digest of the ``Authorization: Bearer`` token, never
the token; a request without one is ``http-anonymous``. Standard library only, so any
layer above the server may use it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

__all__ = ["ANONYMOUS", "key_scope"]

ANONYMOUS = "http-anonymous"


def key_scope(headers: Mapping[str, str]) -> str:
    """The scope of a request's ``Authorization: Bearer`` key (``headers``: lower-case
    names, as Starlette's and Ray Serve's are): ``http-`` and 16 hex digits of its
    BLAKE2b digest, or :data:`ANONYMOUS`."""
    auth = headers.get("authorization", "")
    key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    if not key:
        return ANONYMOUS
    return "http-" + hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
