"""The engine server: wire protocol, socket server, ``pie-ctx serve``/``stats`` commands.

Modules: ``framing`` (length-prefixed frames), ``wire`` (handshake and envelopes),
``endpoint`` (addresses, runtime folder, token files), ``server`` (connections ->
engine owners), ``run`` (listeners, signals), ``cli``, ``testing``. Importing this
package imports nothing else (no torch, no engine).
"""
