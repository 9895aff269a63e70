"""bench.grammar_abuse's never-read streams come from another address than the canary
(the server shares its running slots per client), and the default address follows the
target: 127.0.0.2 next to a server on IPv4 loopback, the system's choice elsewhere."""

from __future__ import annotations

import socket
import threading

from bench.grammar_abuse import Target, _ipv4_loopback, idle_streams


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
