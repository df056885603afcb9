"""The README's inferlet runs as written."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

from pie_ctx.loading import inferlet_args
from tests.sdk.harness import tiny_runtime

README = Path(__file__).resolve().parents[2] / "README.md"


async def test_readme_inferlet_runs(tiny_folder):
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    assert len(code.splitlines()) <= 25
    module = ModuleType("readme")
    exec(compile(code, "README.md", "exec"), module.__dict__)
    namespace = module.__dict__
    args = inferlet_args(module, ["Name a black cat.", "--n", "2"], prog="best_of_4.py")
    assert (args.question, args.n) == ("Name a black cat.", 2)
    async with tiny_runtime(tiny_folder) as rt:
        best = await namespace["main"](rt, args)
        assert isinstance(best, str)
        again = await namespace["again"](rt)
        assert isinstance(again, str)
        assert await rt.snapshots() == ["cat-prompt"]
