"""bench.grammar_abuse's never-read streams and slow headers come from another address
than the canary (the server shares its running slots per client), and the default address
follows the target: 127.0.0.2 next to a server on IPv4 loopback, the system's choice
elsewhere. The slow headers report what each connection got back, and the server's
resident memory is read from its /metrics."""

from __future__ import annotations

import http.server
import json
import socket
import threading

from bench.grammar_abuse import (
    Target,
    _ipv4_loopback,
    idle_streams,
    many_regexes,
    slow_headers,
    summarize,
)
from engine.grammar_spec import MAX_REGEX_CHARS


def test_idle_streams_connect_from_the_attack_address() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        target = Target(f"http://127.0.0.1:{port}", None, attack_from="127.0.0.2")
        attack = threading.Thread(target=idle_streams, args=(target, 2, 0.5))
        attack.start()
        peers, heads = [], []
        for _ in range(2):
            conn, peer = listener.accept()
            with conn:
                peers.append(peer[0])
                heads.append(conn.recv(4096))
        attack.join(10)
    assert peers == ["127.0.0.2", "127.0.0.2"]
    assert all(head.startswith(b"POST /v1/completions HTTP/1.1\r\n") for head in heads)


def test_the_default_attack_address_follows_the_target() -> None:
    assert _ipv4_loopback("http://127.0.0.1:8000")
    assert _ipv4_loopback("http://localhost:8000")
    assert not _ipv4_loopback("http://[::1]:8000")  # the streams are IPv4 sockets
    assert not _ipv4_loopback("http://10.1.2.3:8000")
    assert not _ipv4_loopback("http://hiserve:8000")


def test_slow_headers_trickle_and_report_each_reply() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        target = Target(f"http://127.0.0.1:{port}", None, attack_from="127.0.0.2")
        statuses: list[int] = []
        attack = threading.Thread(target=lambda: statuses.extend(slow_headers(target, 3, 2.5)))
        attack.start()
        conns = []
        for code in (503, 408, None):
            conn, peer = listener.accept()
            assert peer[0] == "127.0.0.2"
            assert conn.recv(4096).startswith(b"POST /v1/completions HTTP/1.1\r\n")
            if code:
                conn.sendall(f"HTTP/1.1 {code} Nope\r\ncontent-length: 0\r\n\r\n".encode())
            conns.append(conn)
        conns[2].settimeout(5)
        trickle = conns[2].recv(16)  # a byte a second while held: headers never finish
        attack.join(15)
        for conn in conns:
            conn.close()
    assert trickle.startswith(b"x") and b"\r\n\r\n" not in trickle
    assert statuses == [503, 408, 0]
    assert summarize(statuses) == "0,408,503"
    assert summarize([200, 400, 200]) == "200x2,400" and summarize([]) == "-"


def test_resident_memory_comes_from_metrics() -> None:
    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"# TYPE process_resident_memory_bytes gauge\n"
            body += b"process_resident_memory_bytes 1.2345e+09\nprocess_open_fds 12.0\n"
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        target = Target(f"http://127.0.0.1:{server.server_address[1]}", None)
        assert target.resident_mb() == 1234.5
        server.shutdown()


def test_many_regexes_sends_distinct_patterns_the_server_accepts() -> None:
    bodies: list[dict[str, object]] = []

    class Completions(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            bodies.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Completions) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        statuses = many_regexes(Target(f"http://127.0.0.1:{server.server_address[1]}", None))
        server.shutdown()
    patterns = [str(body["guided_regex"]) for body in bodies]
    assert statuses == [200] * 16 and len(set(patterns)) == 16
    # The review's size (2.4 KB), inside the regex cap, so each one compiles.
    assert all(2300 <= len(p) <= MAX_REGEX_CHARS for p in patterns)
