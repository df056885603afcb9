"""Docs that are generated or quoted stay true."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_api_reference_is_current():
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_api.py"), "--check"], check=True)


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in readme and "make test" in ci
