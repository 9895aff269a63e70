"""Replay issue 25's grammar, output-size and request-copy attacks, its slow headers and
its streams that are never read, against a running server, with a canary measuring what
each costs everyone else.

    python -m bench.grammar_abuse --base-url http://127.0.0.1:8000 [--api-key KEY]

Meanwhile a canary thread sends an 8-token completion every 0.5 s and a /health probe
every 0.1 s. For each attack it prints the replies' status codes and the attack's wall
time, the worst /health and canary latency while it ran, and the server's resident
memory (``process_resident_memory_bytes`` from /metrics) before the attack and 2 s after
it. Start with a quiet baseline (no attack) to compare against.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import random
import socket
import string
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

Attack = Callable[["Target"], list[int]]


@dataclass
class Target:
    base_url: str
    api_key: str | None
    # The local address the never-read streams connect from: another client than the
    # canary's, as an attacker's host would be (the running slots are shared per client).
    attack_from: str = ""

    def post(self, path: str, body: dict[str, object] | str, timeout: float = 300) -> int:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        content = body if isinstance(body, str) else json.dumps(body)
        resp = httpx.post(self.base_url + path, content=content, headers=headers, timeout=timeout)
        return resp.status_code

    def resident_mb(self) -> float | None:
        """The server's resident memory in MB (10^6 bytes), from its /metrics."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            text = httpx.get(self.base_url + "/metrics", headers=headers, timeout=30).text
        except httpx.HTTPError:
            return None
        for line in text.splitlines():
            if line.startswith("process_resident_memory_bytes "):
                return float(line.split()[1]) / 1e6
        return None


@dataclass
class Canary:
    """Worst /health and tiny-completion latencies since the last ``reset``."""

    target: Target
    health_max: float = 0.0
    canary_max: float = 0.0
    failures: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def reset(self) -> None:
        self.health_max = self.canary_max = 0.0
        self.failures = 0

    def _health(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            try:
                ok = httpx.get(self.target.base_url + "/health", timeout=120).status_code == 200
            except httpx.HTTPError:
                ok = False
            self.failures += not ok
            self.health_max = max(self.health_max, time.perf_counter() - started)
            time.sleep(0.1)

    def _complete(self) -> None:
        body = {"prompt": "The sky is", "max_tokens": 8, "temperature": 0}
        while not self._stop.is_set():
            started = time.perf_counter()
            try:
                ok = self.target.post("/v1/completions", body, timeout=120) == 200
            except httpx.HTTPError:
                ok = False
            self.failures += not ok
            self.canary_max = max(self.canary_max, time.perf_counter() - started)
            time.sleep(0.5)

    def start(self) -> None:
        for loop in (self._health, self._complete):
            threading.Thread(target=loop, daemon=True).start()

    def stop(self) -> None:
        self._stop.set()


def _nested_arrays(depth: int) -> str:
    return '{"type":"array","items":' * depth + '{"type":"integer"}' + "}" * depth


def deep_schema(t: Target) -> list[int]:
    """950 nested arrays (35 KB): froze /health for 38.6 s before the depth cap."""
    body = '{"prompt": "x", "max_tokens": 4, "guided_json": ' + _nested_arrays(950) + "}"
    return [t.post("/v1/completions", body)]


def ambiguous_ebnf(t: Target) -> list[int]:
    """The EBNF whose per-token mask cost grows without bound, n=8 (canary 48 s before)."""
    body = {
        "prompt": "Write words:",
        "max_tokens": 64,
        "n": 8,
        "guided_grammar": "root ::= x\nx ::= [a-z]* | x x | x x x",
    }
    return [t.post("/v1/completions", body)]


def slow_compiles(t: Target) -> list[int]:
    """Two slow-to-compile schemas on both compile workers, then an unrelated choice."""

    def slow(k: int) -> int:
        schema = {
            "type": "object",
            "properties": {
                f"p{i}": {"type": "string", "minLength": 90 + k + i, "maxLength": 128}
                for i in range(6)
            },
        }
        return t.post("/v1/completions", {"prompt": "x", "max_tokens": 2, "guided_json": schema})

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(slow, k) for k in range(2)]
        time.sleep(1.0)
        choice = t.post(
            "/v1/completions", {"prompt": "x", "max_tokens": 2, "guided_choice": ["yes", "no"]}
        )
        return [f.result() for f in futures] + [choice]


def many_regexes(t: Target, count: int = 16) -> list[int]:
    """16 distinct alternation regexes of 2.4 KB (300 words of 7 letters): they once added
    870 MB that stayed (a 512-entry cache outside xgrammar's memory accounting)."""
    rng = random.Random(25)
    statuses = []
    for _ in range(count):
        words = ("".join(rng.choices(string.ascii_lowercase, k=7)) for _ in range(300))
        pattern = "(" + "|".join(words) + ")"
        body = {"prompt": "x", "max_tokens": 4, "guided_regex": pattern}
        statuses.append(t.post("/v1/completions", body))
    return statuses


def logprob_flood(t: Target) -> list[int]:
    body = {"prompt": "x", "max_tokens": 8000, "n": 128, "logprobs": 20}
    return [t.post("/v1/completions", body)]


def long_stops(t: Target) -> list[int]:
    body = {"prompt": "x", "max_tokens": 32, "stop": ["q" * 60_000] * 16}
    return [t.post("/v1/completions", body)]


def copies_flood(t: Target) -> list[int]:
    """A 7.4K-token prompt with n=64 and max_tokens=1 (each copy's one-token prefill read
    the whole prefix: canary 33.7 s before the n x prompt budget), alongside 2 prompts of
    ~480 tokens x n=128, which fit the budget and must share the engine fairly."""
    long_body = {"prompt": "hello " * 7400, "n": 64, "max_tokens": 1}
    pair_body = {"prompt": ["one two three " * 160, "four five six " * 160], "n": 128}
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(t.post, "/v1/completions", long_body),
            pool.submit(t.post, "/v1/completions", {**pair_body, "max_tokens": 1}),
        ]
        return [f.result() for f in futures]


def _status_of(sock: socket.socket) -> int:
    """The status code of the reply waiting on ``sock`` (0: none, or the reset)."""
    try:
        head = sock.recv(64)
    except OSError:
        return 0
    parts = head.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def slow_headers(t: Target, count: int = 2000, hold_s: float = 15.0) -> list[int]:
    """2,000 connections from ``t.attack_from`` sending their request headers a byte a
    second (slowloris; 20,100 of them took every descriptor before the connection caps),
    held ``hold_s`` seconds, past the default 10 s --header-timeout. Returns what each
    got: 503 (over --max-connections-per-client), 408 (headers too slow), 0 (nothing)."""
    url = urllib.parse.urlsplit(t.base_url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    start = f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nX-Slow: ".encode()
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.settimeout(2.0)
            if t.attack_from:
                sock.bind((t.attack_from, 0))
            with contextlib.suppress(OSError):  # refused or reset: its status says so
                sock.connect((host, port))
                sock.sendall(start)
            sockets.append(sock)
        deadline = time.monotonic() + hold_s
        while time.monotonic() < deadline:
            for sock in sockets:
                with contextlib.suppress(OSError):  # the server has answered and closed it
                    sock.send(b"x")
            time.sleep(1.0)
        for sock in sockets:
            sock.settimeout(0.2)
        return [_status_of(sock) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def idle_streams(t: Target, count: int = 80, hold_s: float = 30.0) -> list[int]:
    """80 streams of 3,000 tokens whose clients never read (the canary waited 46 s before
    the send timeout): raw sockets with a 1 KiB receive buffer, held ``hold_s`` seconds
    (past the default 15 s --send-timeout once the buffers are full), then closed, all
    from ``t.attack_from`` (another client than the canary). No reply is read, so there
    are no statuses; the canary and /health tell the cost."""
    url = urllib.parse.urlsplit(t.base_url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    body = json.dumps(
        {"prompt": "Tell a long story.", "max_tokens": 3000, "stream": True, "ignore_eos": True}
    ).encode()
    auth = f"Authorization: Bearer {t.api_key}\r\n" if t.api_key else ""
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{auth}\r\n"
    ).encode()
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            if t.attack_from:
                sock.bind((t.attack_from, 0))
            sock.connect((host, port))
            sock.sendall(head + body)
            sockets.append(sock)
        time.sleep(hold_s)
    finally:
        for sock in sockets:
            sock.close()
    return []


ATTACKS: dict[str, Attack] = {
    "quiet": lambda t: [],
    "deep_schema": deep_schema,
    "ambiguous_ebnf": ambiguous_ebnf,
    "slow_compiles": slow_compiles,
    "many_regexes": many_regexes,
    "logprob_flood": logprob_flood,
    "long_stops": long_stops,
    "copies_flood": copies_flood,
    "slow_headers": slow_headers,
    "idle_streams": idle_streams,
}


def summarize(statuses: list[int]) -> str:
    """``[200, 200, 400]`` -> ``"200x2,400"``; no replies -> ``"-"``."""
    counts = Counter(statuses)
    text = ",".join(f"{code}x{n}" if n > 1 else str(code) for code, n in sorted(counts.items()))
    return text or "-"


def _mb(value: float | None) -> str:
    return "?" if value is None else f"{value:.0f}"


def _ipv4_loopback(base_url: str) -> bool:
    """Whether the server is on 127.0.0.0/8, where 127.0.0.2 is another local address."""
    host = urllib.parse.urlsplit(base_url).hostname or ""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:  # a name: its address is not known here
        return False
    return address.version == 4 and address.is_loopback


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--attacks", nargs="+", choices=list(ATTACKS), default=list(ATTACKS))
    parser.add_argument("--quiet-s", type=float, default=5.0, help="length of the baseline")
    parser.add_argument(
        "--attack-from",
        default=None,
        help="local address idle_streams and slow_headers connect from, another client "
        "than the canary "
        "(default: 127.0.0.2 for a server on a loopback address, else the system's choice)",
    )
    args = parser.parse_args(argv)
    base_url = args.base_url.rstrip("/")
    attack_from = args.attack_from
    if attack_from is None:
        attack_from = "127.0.0.2" if _ipv4_loopback(base_url) else ""
    target = Target(base_url, args.api_key, attack_from)
    canary = Canary(target)
    canary.start()
    time.sleep(1.0)
    print(
        f"{'attack':16} {'status':24} {'wall s':>7} {'health max s':>12} "
        f"{'canary max s':>12} {'RSS MB before/after':>20}"
    )
    for name in args.attacks:
        before = target.resident_mb()
        canary.reset()
        started = time.perf_counter()
        statuses = ATTACKS[name](target)
        if name == "quiet":
            time.sleep(args.quiet_s)
        wall = time.perf_counter() - started
        time.sleep(0.6)  # let the canary in flight land inside this attack's window
        health, worst, failures = canary.health_max, canary.canary_max, canary.failures
        time.sleep(1.4)  # memory is read 2 s after the attack
        after = target.resident_mb()
        print(
            f"{name:16} {summarize(statuses):24} {wall:7.2f} {health:12.3f} {worst:12.3f} "
            f"{_mb(before):>9}/{_mb(after):<10}"
            + (f"  ({failures} canary failures)" if failures else "")
        )
    canary.stop()


if __name__ == "__main__":
    main()
