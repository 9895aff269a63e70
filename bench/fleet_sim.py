"""A simulated replica for trying router policies fast: ``python -m bench.fleet_sim PORT``.

It answers what smg asks of a replica (``/health``, ``/v1/models``, ``/v1/loads``,
``/flush_cache``) and streams ``/v1/completions`` with ``usage`` like hiserve, but runs
no model: a prompt's tokens are its words (``--prompt-mode text`` prompts are words), its
cached tokens the longest word prefix it shares with any prompt this replica saw before
(an unbounded prefix cache), and its time ``--prefill`` seconds per uncached token,
shared among the requests running at once, plus ``--decode`` seconds per output token.
Routing decisions and hit rates come out as with real replicas (a round_robin run gave
the same hit rate, 27.8% of an ideal 58.3%, on both); only the times are made up.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODEL = "sim"


class SimReplica:
    """The shared state of one simulated replica."""

    def __init__(self, prefill: float, decode: float) -> None:
        self.prefill, self.decode = prefill, decode
        self.lock = threading.Lock()
        self.seen: list[list[str]] = []
        self.running = 0

    def admit(self, words: list[str]) -> int:
        """Cached tokens of this prompt; it is cached itself from now on."""
        with self.lock:
            best = max((_common(words, s) for s in self.seen), default=0)
            self.seen.append(words)
            self.running += 1
        return min(best, max(len(words) - 1, 0))

    def work(self, uncached: int) -> None:
        """Prefill time, shared with the other running requests (processor sharing)."""
        need, done = self.prefill * uncached, 0.0
        while done < need:
            time.sleep(0.005)
            done += 0.005 / max(self.running, 1)

    def release(self) -> None:
        with self.lock:
            self.running -= 1

    def flush(self) -> None:
        with self.lock:
            self.seen.clear()


def _common(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def handler(sim: SimReplica) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _json(self, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            if path == "/health":
                self._json({"status": "ok"})
            elif path == "/v1/models":
                self._json({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
            elif path == "/v1/loads":
                load: dict[str, Any] = {"dp_rank": 0, "num_running_reqs": sim.running}
                load.update(num_waiting_reqs=0, num_used_tokens=0, max_total_num_tokens=1 << 20)
                load["token_usage"] = 0.0
                self._json({"timestamp": "", "dp_rank_count": 1, "loads": [load]})
            else:
                self.send_error(404)

        def _body(self) -> bytes:
            if "chunked" not in self.headers.get("Transfer-Encoding", ""):
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))
            out = b""
            while size := int(self.rfile.readline().split(b";")[0], 16):
                out += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
            return out

        def _event(self, event: dict[str, Any] | str) -> None:
            text = event if isinstance(event, str) else json.dumps(event)
            data = f"data: {text}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def do_POST(self) -> None:
            body = json.loads(self._body() or b"{}")
            if self.path.startswith("/flush_cache"):
                sim.flush()
                return self._json({})
            words, out = str(body.get("prompt", "")).split(), int(body.get("max_tokens", 1))
            cached = sim.admit(words)
            try:
                sim.work(len(words) - cached)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for i in range(out):
                    choice = {"index": 0, "text": " w", "finish_reason": None}
                    self._event({"object": "text_completion", "model": MODEL, "choices": [choice]})
                    if i < out - 1:
                        time.sleep(sim.decode)
                usage: dict[str, Any] = {"prompt_tokens": len(words), "completion_tokens": out}
                usage["total_tokens"] = len(words) + out
                usage["prompt_tokens_details"] = {"cached_tokens": cached}
                self._event(
                    {"object": "text_completion", "model": MODEL, "choices": [], "usage": usage}
                )
                self._event("[DONE]")
                self.wfile.write(b"0\r\n\r\n")
            finally:
                sim.release()

    return Handler


def serve(
    port: int, prefill: float = 0.01, decode: float = 0.1, host: str = "127.0.0.1"
) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), handler(SimReplica(prefill, decode)))
    server.daemon_threads = True
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("port", type=int)
    parser.add_argument("--prefill", type=float, default=0.01, help="seconds per uncached token")
    parser.add_argument("--decode", type=float, default=0.1, help="seconds per output token")
    args = parser.parse_args()
    serve(args.port, args.prefill, args.decode).serve_forever()


if __name__ == "__main__":
    main()
