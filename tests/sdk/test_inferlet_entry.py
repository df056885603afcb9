"""The inferlet entry point as ``pie-ctx run`` sees it: ``main(rt, args)`` with ``args`` an
``argparse.Namespace``; a file whose entry points have the wrong shape gets a one-line
error showing the expected one, and a bug in the inferlet's own code keeps its traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from pie_ctx.errors import InvalidArgument
from pie_ctx.loading import inferlet_args, load_inferlet
from runtime.cli import main as cli_main

WRONG_SHAPES = {
    "def main(rt, args):\n    pass\n": "`def main(rt, args)`",
    "async def main(rt):\n    pass\n": "`async def main(rt)`",
    "async def main():\n    pass\n": "`async def main()`",
    "async def main(rt, args, extra):\n    pass\n": "`async def main(rt, args, extra)`",
    "main = 3\n": "`main = 3`",
    "async def run(rt, args):\n    pass\n": "has no main",
    "async def main(rt, args):\n    pass\n\nasync def add_arguments(parser):\n    pass\n":
        "`async def add_arguments(parser)`",
    "async def main(rt, args):\n    pass\n\ndef add_arguments():\n    pass\n":
        "`def add_arguments()`",
}


def _write(tmp_path: Path, code: str, name: str = "inferlet.py") -> Path:
    path = tmp_path / name
    path.write_text(code)
    return path


@pytest.mark.parametrize("code", list(WRONG_SHAPES))
def test_a_wrong_entry_point_is_a_one_line_error_showing_the_shape(code, tmp_path, capsys):
    path = _write(tmp_path, code)
    with pytest.raises(InvalidArgument, match="must be|has no main"):
        load_inferlet(path)
    # no model is booted: the file is checked first
    assert cli_main(["run", str(path), "--model", str(tmp_path / "no-model")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("pie-ctx: error: ") and WRONG_SHAPES[code] in err, err
    expected = "def add_arguments(parser)" if "add_arguments" in code else \
        "async def main(rt, args)"
    assert expected in err and str(path) in err


def test_shapes_that_run(tmp_path):
    for code in ("async def main(rt, args=None):\n    pass\n",
                 "async def main(*argv):\n    pass\n",
                 "async def main(rt, args):\n    pass\n\ndef add_arguments(parser, x=1):\n    pass\n"):
        assert load_inferlet(_write(tmp_path, code)).main


def test_args_is_a_namespace_of_the_inferlets_own_options(tmp_path):
    plain = load_inferlet(_write(tmp_path, "async def main(rt, args):\n    pass\n", "a.py"))
    args = inferlet_args(plain, ["a question", "--flag"], prog="a.py")
    assert args.argv == ["a question", "--flag"]
    own = load_inferlet(_write(tmp_path, (
        "async def main(rt, args):\n    pass\n\n"
        "def add_arguments(parser):\n"
        "    parser.add_argument('question')\n"
        "    parser.add_argument('--n', type=int, default=2)\n"), "b.py"))
    args = inferlet_args(own, ["why?", "--n", "3"], prog="b.py")
    assert (args.question, args.n) == ("why?", 3) and not hasattr(args, "argv")


def test_a_bug_at_import_keeps_its_traceback(tmp_path):
    path = _write(tmp_path, "import json\n\nvalue = json.loads('{')\n")
    with pytest.raises(ValueError) as err:
        cli_main(["run", str(path), "--model", str(tmp_path / "no-model")])
    assert any(entry.path == path for entry in err.traceback)


@pytest.mark.fp32_only("the runner, not the model: one dtype is enough")
def test_a_bug_inside_main_keeps_its_traceback(tiny_folder, tmp_path):
    path = _write(tmp_path, ("async def main(rt, args):\n"
                             "    return args['question']  # a Namespace is not a dict\n"))
    with pytest.raises(TypeError, match="not subscriptable") as err:
        cli_main(["run", str(path), "--model", str(tiny_folder), "--page-size", "4"])
    assert any(entry.path == path for entry in err.traceback)
