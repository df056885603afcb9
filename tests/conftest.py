from __future__ import annotations

from pathlib import Path

import pytest

from tests.sdk.harness import tiny_model_folder


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_folder(tmp_path_factory.mktemp("sdk"))


@pytest.fixture(params=["local", "socket"])
def transport(request: pytest.FixtureRequest) -> str:
    """Every SDK test runs in-process and over the server's Unix socket."""
    return request.param
