"""The server's start-up and first request import none of the modules it never uses.

transformers' Llama config module (through ``type_validators`` -> ``activations`` ->
``hub_kernels`` -> ``core_model_loading`` -> ``torch.distributed.tensor``) and torch's
meta ``empty_like`` (through ``torch.fx``'s symbolic shapes) each pulled sympy in, about
100 MiB of resident memory together (docs/weights.md). A real server (``main``, the
default packed model) runs in a fresh interpreter with a thread that waits for
``/health``, sends one completion, records which of those modules are loaded, and ends
the server with SIGTERM.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.integration.conftest import REPO, bound_socket
from tests.unit.test_hf_config import HEAVY_MODULES

_SERVE_AND_LOOK = """
import json, os, signal, sys, threading, time, urllib.request
from server.__main__ import main

fd, port, out, heavy = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
base = f"http://127.0.0.1:{port}"


def look():
    found = {}
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.25)
        found["ready"] = sorted(m for m in heavy if m in sys.modules)
        body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        request = urllib.request.Request(
            base + "/v1/completions", json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        found["status"] = urllib.request.urlopen(request, timeout=120).status
        found["served"] = sorted(m for m in heavy if m in sys.modules)
    finally:
        with open(out, "w") as fh:
            json.dump(found, fh)
        os.kill(os.getpid(), signal.SIGTERM)


threading.Thread(target=look, daemon=True).start()
sys.exit(main([
    "--model", "default", "--device", "cpu", "--kv-cache-tokens", "1024",
    "--host", "127.0.0.1", "--port", str(port), "--fd", str(fd),
]))
"""


def test_server_start_and_first_request_import_nothing_heavy(tmp_path: Path) -> None:
    sock = bound_socket()
    port = int(sock.getsockname()[1])
    out = tmp_path / "modules.json"
    log = tmp_path / "server.log"
    try:
        with log.open("wb") as fh:
            proc = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    _SERVE_AND_LOOK,
                    str(sock.fileno()),
                    str(port),
                    str(out),
                    json.dumps(HEAVY_MODULES),
                ],
                cwd=REPO,
                stdout=fh,
                stderr=subprocess.STDOUT,
                pass_fds=(sock.fileno(),),
                timeout=420,
                check=False,
            )
    finally:
        sock.close()
    found = json.loads(out.read_text()) if out.exists() else {}
    assert found.get("status") == 200, log.read_text(errors="replace")[-4000:]
    assert proc.returncode == 0, log.read_text(errors="replace")[-4000:]
    assert found["ready"] == []
    assert found["served"] == []
