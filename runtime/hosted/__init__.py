"""Hosted inferlets: the parts that run inferlets inside the engine's process (docs/inferlets.md).

They use the SDK (a launch runs its inferlet on a ``pie_ctx.Runtime``), so in the package
order they sit above it, beside the server (docs/design.md); the engine's own side, the
launch and store requests and ``rt.store``'s files, lives in ``runtime.engine``
(``hosted_requests``, ``inferlet_store``).

* ``folder``: the operator's folder, the only source of launchable code;
* ``host``: launches, each on its own thread and event loop, one engine owner each;
* ``bridge``: the in-process transport between a launch's loop and the engine's.
"""
