"""A plain install works: the demo runs and a served chat completion answers.

Run by ``make test-install`` with the python of a fresh venv holding pie-ctx without
extras (``pip install .``), from the repository root: it runs
``pie-ctx run examples/hello.py`` (from the venv's folder, away from the repository's
packages), then starts ``pie-ctx serve --http PORT``, sends one
``POST /v1/chat/completions`` with the standard library's HTTP client, checks the answer
and stops the server. Only the standard library here: the venv has no test tools.
Exits 0 when both worked, 1 otherwise (with what failed on stderr).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent
HELLO = Path(__file__).resolve().parents[1] / "examples" / "hello.py"
# A first start may fetch and convert the default model, and build pie-ctx's CPU kernels
# (or wait for another process building them).
START_TIMEOUT_S = 600.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict[str, object], timeout: float) -> dict[str, object]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read())


def _wait_ready(base: str, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"pie-ctx serve exited with {server.returncode} before serving")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    raise SystemExit(f"pie-ctx serve did not answer {base}/health in {START_TIMEOUT_S:.0f} s")


def main() -> int:
    # Away from the repository, so that only the installed packages can be imported.
    os.chdir(BIN.parent)
    demo = subprocess.run([str(BIN / "pie-ctx"), "run", str(HELLO), "--",
                           "--max-tokens", "16"], capture_output=True, text=True)
    if demo.returncode != 0 or not demo.stdout.strip():
        print(f"pie-ctx run examples/hello.py failed ({demo.returncode}):\n{demo.stderr}",
              file=sys.stderr)
        return 1
    print(f"demo: {demo.stdout.strip()!r}")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    # Its own socket and no snapshot folder: a server already running here keeps theirs.
    server = subprocess.Popen([str(BIN / "pie-ctx"), "serve", "--http", str(port),
                               "--socket", str(BIN.parent / "engine.sock"),
                               "--memory-snapshots"],
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        _wait_ready(base, server)
        reply = _post(f"{base}/v1/chat/completions",
                      {"model": "smollm2-135m-instruct", "max_tokens": 16, "temperature": 0,
                       "messages": [{"role": "user", "content": "Say hello."}]}, timeout=120)
        choices = reply.get("choices")
        text = choices[0]["message"]["content"] if isinstance(choices, list) else None
        if not isinstance(text, str) or not text:
            print(f"the chat completion has no text: {reply}", file=sys.stderr)
            return 1
        print(f"served: {text!r}")
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
