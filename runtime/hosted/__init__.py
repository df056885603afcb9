"""Hosted inferlets and the store (docs/inferlets.md).

* ``folder``: the operator's folder, the only source of launchable code;
* ``host``: launches, each on its own thread and event loop, one engine owner each;
* ``bridge``: the in-process transport between a launch's loop and the engine's;
* ``store``: ``rt.store``, small durable values per namespace;
* ``requests``: the engine's handlers for the launch and store requests.
"""
