"""The fleet's tests (``make test-fleet``): a local Ray instance with 2 engine replicas of
the tiny model. They need the optional extra ``ray`` (skipped without it) and run only
when ``PIE_CTX_TEST_FLEET=1`` (set by ``make test-fleet``), so the default suite does not
pay for a Ray cluster."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PIE_CTX_TEST_FLEET") == "1":
        return
    skip = pytest.mark.skip(reason="the fleet's tests run in `make test-fleet` "
                                   "(PIE_CTX_TEST_FLEET=1)")
    for item in items:
        if "tests/fleet/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)
