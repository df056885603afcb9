from __future__ import annotations

import os

import pytest

from tests.sdk.harness import TinyModel, tiny_model_folder

DTYPES = ("float32", "bfloat16")  # every test on the tiny model runs in each
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run each test that takes ``tiny_folder`` in fp32 and bf16, and in fp16 too when it
    is marked ``fp16``; ``fp32_only`` (with its reason) keeps a test to fp32."""
    if "tiny_folder" not in metafunc.fixturenames:
        return
    dtypes = list(DTYPES)
    if metafunc.definition.get_closest_marker("fp16"):
        dtypes.append("float16")
    if metafunc.definition.get_closest_marker("fp32_only"):
        dtypes = ["float32"]
    metafunc.parametrize("tiny_folder", dtypes, indirect=True, ids=[SHORT[d] for d in dtypes])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The SDK suite runs again against other engines (``make test-tp``: tensor parallel,
    ``PIE_CTX_TEST_TP``; ``make test-backend``: the transformers backend,
    ``PIE_CTX_TEST_BACKEND``). Tests of what such an engine refuses by design (marked
    ``no_tp`` / ``native_only`` with the reason) do not run there: the refusals themselves
    are tested in tests/parallel and tests/sdk/test_transformers_backend.py."""
    skips = []
    if int(os.environ.get("PIE_CTX_TEST_TP", "1")) > 1:
        skips.append(("no_tp", "tensor parallel"))
    if os.environ.get("PIE_CTX_TEST_BACKEND", "native") != "native":
        skips.append(("native_only", "transformers backend"))
    for item in items:
        for name, why in skips:
            marker = item.get_closest_marker(name)
            if marker is not None:
                item.add_marker(pytest.mark.skip(reason=f"{why}: {marker.args[0]}"))


def _session_env(name: str, value: str):
    """Set environment variable ``name`` for the session, then put back what was there."""
    old = os.environ.get(name)
    os.environ[name] = value
    yield
    if old is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = old


@pytest.fixture(scope="session", autouse=True)
def _data_home(tmp_path_factory: pytest.TempPathFactory):
    """Servers the tests start keep snapshots in a session folder, never in the user's
    ~/.local/share (``serve``'s default snapshot directory)."""
    yield from _session_env("XDG_DATA_HOME", str(tmp_path_factory.mktemp("data-home")))


@pytest.fixture(scope="session", autouse=True)
def _machine_cache(tmp_path_factory: pytest.TempPathFactory):
    """The kernel probe and calibration results (``runtime.model.machine_cache``) go to a
    session folder, never to the developer's ~/.cache/pie-ctx: a test's result never
    depends on what an earlier run left there (the compiled kernels stay where they are:
    building them takes minutes). Servers the tests start inherit the folder, so a model
    probed once in the session is not probed again by each server."""
    yield from _session_env("PIE_CTX_MACHINE_CACHE_DIR",
                            str(tmp_path_factory.mktemp("machine-cache")))


@pytest.fixture(scope="session")
def tiny_folder_path(tmp_path_factory: pytest.TempPathFactory):
    return tiny_model_folder(tmp_path_factory.mktemp("sdk"))


@pytest.fixture
def tiny_folder(request: pytest.FixtureRequest, tiny_folder_path) -> TinyModel:
    """The tiny model, in the dtype this run of the test uses (see pytest_generate_tests)."""
    return TinyModel(tiny_folder_path, getattr(request, "param", "float32"))


@pytest.fixture(params=["local", "socket"])
def transport(request: pytest.FixtureRequest) -> str:
    """Every SDK test runs in-process and over the server's Unix socket."""
    return request.param
