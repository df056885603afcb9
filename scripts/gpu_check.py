"""The GPU check: one prepared command for a GPU machine lent for minutes, offline.

    python3 scripts/gpu_check.py [--wheels DIR] [--allow-no-flash] [--log gpu-check.log]
    make gpu-check WHEELS=DIR [GPU_CHECK_ARGS=--allow-no-flash]

Uses the machine's ``python3`` and its CUDA torch; builds no venv and reaches no index.
With ``--wheels`` (a folder from ``scripts/gpu_wheels.py``) the project's other
dependencies are installed from it with ``--no-index`` into a target folder put first on
``PYTHONPATH``. Then, each step a subprocess with its own time limit, all within
``--budget`` seconds (8 minutes on an H100):

1. the tests marked ``cuda``;
2. the kernel report (``scripts/attention_kernels.py``) for each asked backend (flash-attn
   unless ``--allow-no-flash``, and flex) at page sizes 16 and 256: each run asserts that
   the backend it asked for is the one that ran;
3. ``benchmarks/best_of_n.py`` in bf16 at page sizes 16 and 256: the default backend,
   then flex without and with CUDA graphs for decode (``PIE_CTX_CUDA_GRAPHS=1``);
4. ``benchmarks/model.py`` in bf16 (reduced: 512-token prompt, 64 tokens, 2 repeats).

Everything printed goes to the log file, which ends with one JSON line (also printed):
``ok``, the device, torch, whether flash-attn imported, each step's status and seconds,
and the kernel reports. Exit status: 2 when torch sees no CUDA device (nothing else runs),
1 when a step failed or an asked-for backend did not run, 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class Log:
    """Everything to the log file and to stdout."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("w")

    def __call__(self, text: str) -> None:
        print(text, flush=True)
        self.file.write(text + "\n")
        self.file.flush()


def cuda_status() -> tuple[bool, dict]:
    """Whether this python's torch sees a CUDA device, and what it is."""
    try:
        import torch
    except ImportError as e:
        return False, {"error": f"torch does not import in {sys.executable}: {e}"}
    info = {"python": sys.version.split()[0], "torch": torch.__version__,
            "torch_cuda": torch.version.cuda}
    if not torch.cuda.is_available():
        info["error"] = (f"torch {torch.__version__} in {sys.executable} sees no CUDA device "
                         "(a CPU build of torch, no driver, or no GPU)")
        return False, info
    info["device"] = torch.cuda.get_device_name(0)
    info["capability"] = list(torch.cuda.get_device_capability(0))
    try:
        import flash_attn  # type: ignore[import-not-found]

        info["flash_attn"] = flash_attn.__version__
    except Exception as e:  # absent, or its CUDA extension does not load
        info["flash_attn"] = None
        info["flash_attn_error"] = f"{type(e).__name__}: {e}"[:200]
    return True, info


def install(wheels: Path, target: Path, log: Log) -> int:
    reqs = wheels / "requirements.txt"
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
           "--upgrade", "--find-links", str(wheels), "--target", str(target), "-r", str(reqs)]
    log(f"$ {' '.join(cmd)}")
    env = os.environ | {"PIP_CONFIG_FILE": os.devnull}  # this folder only
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    log(out.stdout + out.stderr)
    return out.returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheels", type=Path, default=None, help="a gpu_wheels.py folder")
    ap.add_argument("--target", type=Path, default=Path("/tmp/pie-ctx-gpu-deps"))
    ap.add_argument("--allow-no-flash", action="store_true",
                    help="run the torch-only paths alone (flex, torch) without flash-attn")
    ap.add_argument("--log", type=Path, default=ROOT / "gpu-check.log")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for all steps")
    args = ap.parse_args()
    log = Log(args.log)
    start = time.monotonic()
    result: dict = {"ok": False, "steps": [], "kernels": []}

    def finish(code: int) -> int:
        result["seconds"] = round(time.monotonic() - start, 1)
        log(json.dumps(result))
        return code

    ok, info = cuda_status()
    result.update(info)
    log(f"gpu-check: {json.dumps(info)}")
    if not ok:
        log(f"gpu-check: FAILED: {info['error']}")
        return finish(2)
    env = dict(os.environ)
    env.pop("PIE_CTX_ATTENTION", None)
    if args.wheels is not None:
        if install(args.wheels, args.target, log) != 0:
            result["error"] = f"installing {args.wheels} with --no-index failed"
            log(f"gpu-check: FAILED: {result['error']}")
            return finish(1)
        env["PYTHONPATH"] = os.pathsep.join([str(args.target), str(ROOT)])
    else:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    backends = ["flex"] if args.allow_no_flash else ["flash", "flex"]
    py = sys.executable
    bench = ["--device", "cuda", "--dtype", "bfloat16"]
    steps: list[tuple[str, list[str], dict, float]] = [
        ("cuda tests", [py, "-m", "pytest", "-q", "-rs", "-m", "cuda", "tests"], {}, 180)]
    for backend in backends:
        for ps in (16, 256):
            steps.append((f"kernels {backend} page {ps}",
                          [py, "scripts/attention_kernels.py", *bench, "--page-size", str(ps),
                           "--backend", backend], {}, 90))
    for ps in (16, 256):  # the default backend, then flex without and with CUDA graphs
        for label, extra in (("default", {}),
                             ("flex", {"PIE_CTX_ATTENTION": "flex"}),
                             ("flex graphs", {"PIE_CTX_ATTENTION": "flex",
                                              "PIE_CTX_CUDA_GRAPHS": "1"})):
            if args.allow_no_flash and label == "default":
                continue  # without flash-attn the default is flex or torch, by measurement
            steps.append((f"best_of_n page {ps} {label}",
                          [py, "benchmarks/best_of_n.py", *bench, "--page-size", str(ps),
                           "--repeats", "2"], extra, 75))
    steps.append(("model bench", [py, "benchmarks/model.py", *bench, "--prompt-len", "512",
                                  "--new-tokens", "64", "--repeats", "2", "--quality-prompts",
                                  "4", "--no-int8"], {}, 150))
    failed = []
    for name, cmd, extra, limit in steps:
        left = args.budget - (time.monotonic() - start)
        if left < 10:
            result["steps"].append({"name": name, "status": "skipped: out of time"})
            failed.append(name)
            continue
        log(f"\n=== {name}: $ {' '.join(cmd)} {extra or ''}")
        t0 = time.monotonic()
        try:
            out = subprocess.run(cmd, cwd=ROOT, env=env | extra, capture_output=True,
                                 text=True, timeout=min(limit, left))
            status = "ok" if out.returncode == 0 else f"exit {out.returncode}"
            text = out.stdout + out.stderr
        except subprocess.TimeoutExpired as e:
            status = f"timeout after {min(limit, left):.0f} s"
            text = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes)
                    else e.stdout or "")
        log(text.rstrip())
        step = {"name": name, "status": status, "seconds": round(time.monotonic() - t0, 1)}
        if name.startswith("kernels"):
            last = text.strip().splitlines()[-2:] if text.strip() else []
            for line in last:
                if line.startswith("{"):
                    result["kernels"].append(json.loads(line))
        result["steps"].append(step)
        log(f"=== {name}: {status} ({step['seconds']} s)")
        if status != "ok":
            failed.append(name)
    if "flash" in backends and not info.get("flash_attn"):
        failed.append("flash-attn asked for but not importable (install the cuda extra, or "
                      "pass --allow-no-flash)")
    result["failed"] = failed
    result["ok"] = not failed
    log(f"gpu-check: {'OK' if not failed else 'FAILED: ' + '; '.join(failed)}")
    return finish(0 if not failed else 1)


if __name__ == "__main__":
    sys.exit(main())
