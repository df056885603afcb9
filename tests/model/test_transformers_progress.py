"""transformers' "Loading weights" bar shows for a terminal and stays out of pipes (what
``pie-ctx run --backend transformers`` prints): ``load_transformers_model`` asks whether
stderr is a terminal."""

from __future__ import annotations

import io
import sys

import pytest

from tests.sdk.harness import tiny_model_folder

pytest.importorskip("transformers")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stream", [io.StringIO, _Terminal], ids=["pipe", "terminal"])
def test_the_loading_bar_is_for_terminals_only(tmp_path_factory, monkeypatch, stream) -> None:
    from transformers.utils import logging as hf_logging

    from runtime.model.transformers_backend.runner import load_transformers_model

    folder = tiny_model_folder(tmp_path_factory.mktemp("model"))
    err = stream()
    monkeypatch.setattr(sys, "stderr", err)
    load_transformers_model(folder, dtype="float32", device="cpu")
    assert ("Loading weights" in err.getvalue()) == err.isatty()
    assert hf_logging.is_progress_bar_enabled()  # put back for the rest of the process
