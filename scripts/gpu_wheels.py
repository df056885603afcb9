"""A wheel folder of everything ``make gpu-check`` needs besides torch, for an offline GPU box.

    python scripts/gpu_wheels.py --python-version 3.12 --out DIR [--platform manylinux_2_28_x86_64]

A GPU machine is lent for minutes, often without a package index, and brings its own
CUDA build of torch. This script, run where PyPI is reachable, resolves the project's
dependencies plus what the CUDA checks import (pytest, transformers for the tiny test
models and the benchmarks' oracle), for the GPU machine's Python and platform, and
downloads them as wheels into ``DIR``, leaving out torch and everything only torch pulls
in (its nvidia-* CUDA wheels, triton, sympy ...): those come with the machine's torch.
``make gpu-check WHEELS=DIR`` then installs them with ``--no-index`` into a target folder
on ``PYTHONPATH``. The folder must stay under 64 MiB (it travels with the work tree); the
script fails if it does not, and says which wheels are largest.

Steps: ``pip install --dry-run --report`` resolves the whole set for the target
interpreter; the dependency closure of the roots is recomputed from the report's metadata
without entering torch; ``pip download --no-deps`` fetches exactly those pins. The
folder's ``requirements.txt`` lists them (``pip install --no-index --no-deps -r``).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 64 * 2**20
# What the CUDA checks import beyond the runtime: the test runner, the tiny HF models of
# the tests and the benchmarks' transformers oracle (accelerate: transformers loads the
# GGUF default model with it), and setuptools to build the project from the folder.
EXTRA = ["pytest", "pytest-asyncio", "hypothesis", "transformers", "accelerate",
         "setuptools>=68", "wheel"]
SKIP = re.compile(r"^(torch|triton|nvidia-.*|pytorch-triton.*)$")


def roots() -> list[str]:
    """The project's dependencies (but torch) and :data:`EXTRA`."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = [d for d in project["dependencies"]
            if canonicalize_name(Requirement(d).name) != "torch"]
    return deps + EXTRA


def resolve(reqs: list[str], python_version: str, platforms: list[str]) -> list[dict]:
    """pip's resolution of ``reqs`` for the target interpreter (the report's ``install``)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
               "--quiet", "--only-binary=:all:", "--python-version", python_version,
               "--target", str(Path(tmp) / "t"), "--report", str(report)]
        for p in platforms:
            cmd += ["--platform", p]
        subprocess.run(cmd + reqs, check=True)
        return json.loads(report.read_text())["install"]


def closure(reqs: list[str], installs: list[dict], python_version: str) -> dict[str, str]:
    """``{name: version}`` reachable from ``reqs`` without entering :data:`SKIP`."""
    env = default_environment() | {"python_version": python_version,
                                   "python_full_version": python_version + ".0",
                                   "sys_platform": "linux", "platform_system": "Linux",
                                   "platform_machine": "x86_64", "implementation_name": "cpython"}
    meta = {canonicalize_name(i["metadata"]["name"]): i["metadata"] for i in installs}
    keep: dict[str, str] = {}
    todo = [(Requirement(r), "") for r in reqs]
    while todo:
        req, extra = todo.pop()
        name = canonicalize_name(req.name)
        if req.marker is not None and not req.marker.evaluate(env | {"extra": extra}):
            continue
        if SKIP.match(name) or name not in meta:
            continue
        extras = set(req.extras)
        seen = keep.get(name)
        if seen is not None and not extras:
            continue
        keep[name] = meta[name]["version"]
        for dep in meta[name].get("requires_dist", []):
            d = Requirement(dep)
            if d.marker is None or d.marker.evaluate(env | {"extra": ""}):
                todo.append((d, ""))
            else:
                todo.extend((d, e) for e in extras if d.marker.evaluate(env | {"extra": e}))
    return keep


def download(pins: dict[str, str], out: Path, python_version: str,
             platforms: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
           "--only-binary=:all:", "--python-version", python_version, "-d", str(out)]
    for p in platforms:
        cmd += ["--platform", p]
    subprocess.run(cmd + [f"{n}=={v}" for n, v in sorted(pins.items())], check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python-version", required=True, help="the GPU machine's, e.g. 3.12")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--platform", action="append", default=None,
                    help="wheel platform tags (default: manylinux x86_64 for glibc 2.17 to "
                         "2.31, which llguidance needs: any current GPU image)")
    args = ap.parse_args()
    platforms = args.platform or ([f"manylinux_2_{m}_x86_64" for m in range(31, 16, -1)]
                                  + ["manylinux2014_x86_64", "linux_x86_64"])
    args.out.mkdir(parents=True, exist_ok=True)
    reqs = roots()
    pins = closure(reqs, resolve(reqs, args.python_version, platforms), args.python_version)
    download(pins, args.out, args.python_version, platforms)
    wheels = sorted(args.out.glob("*.whl"), key=lambda p: p.stat().st_size, reverse=True)
    bad = [w.name for w in wheels if SKIP.match(canonicalize_name(w.name.split("-")[0]))]
    total = sum(w.stat().st_size for w in wheels)
    (args.out / "requirements.txt").write_text(
        "".join(f"{n}=={v}\n" for n, v in sorted(pins.items())))
    print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in {args.out} "
          f"(largest: {', '.join(f'{w.name} {w.stat().st_size / 2**20:.1f}' for w in wheels[:3])})")
    if bad:
        print(f"gpu_wheels: torch or CUDA wheels in the folder: {bad}", file=sys.stderr)
        return 1
    if total >= LIMIT:
        print(f"gpu_wheels: {total / 2**20:.1f} MiB is over the 64 MiB limit", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
