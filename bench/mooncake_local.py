"""A Mooncake Store on 127.0.0.1 for benchmarks and tests: a master and one page holder.

The processes listen on loopback only and are killed by ``stop()``.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from engine.kvcache.storage import KVStore, make_store


def _port() -> int:
    # NOTE: external binaries take a port number, not a socket; the fixture retries.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Mooncake:
    """mooncake_master with its HTTP metadata server, plus a holder of the pages."""

    def __init__(self, segment: str = "64MB") -> None:
        """``segment``: memory the holder gives the store for pages (e.g. "1GB")."""
        self.rpc, self.metrics, self.http, self.holder_port = (_port() for _ in range(4))
        self.master = f"127.0.0.1:{self.rpc}"
        self.metadata = f"http://127.0.0.1:{self.http}/metadata"
        bin_dir = Path(sys.executable).parent
        self.procs = [
            subprocess.Popen(
                [str(bin_dir / "mooncake_master"), "--rpc_address=127.0.0.1",
                 f"--rpc_port={self.rpc}", "--metrics_host=127.0.0.1",
                 f"--metrics_port={self.metrics}", "--enable_http_metadata_server=true",
                 "--http_metadata_server_host=127.0.0.1",
                 f"--http_metadata_server_port={self.http}", "--rpc_thread_num=2"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
        ]  # fmt: skip
        self._wait_port(self.rpc)
        self._wait_port(self.http)
        self.procs.append(
            subprocess.Popen(
                [str(bin_dir / "mooncake_client"), "--host=127.0.0.1",
                 f"--port={self.holder_port}", f"--global_segment_size={segment}",
                 f"--master_server_address={self.master}", f"--metadata_server={self.metadata}",
                 "--protocol=tcp"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
        )  # fmt: skip
        self._wait_port(self.holder_port)

    def _wait_port(self, port: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError("a Mooncake process exited during start-up")
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.05)
        raise TimeoutError(f"Mooncake did not listen on {port}")

    def store(self) -> KVStore:
        store = make_store(
            "mooncake", mooncake_master=self.master, mooncake_metadata_server=self.metadata
        )
        assert store is not None
        return store

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.kill()
            proc.wait(timeout=30)
