"""Client-side helpers of the fleet tests: auth headers, OpenAI clients, conversations
that tell which replica answered, the router's and replicas' load views, and the
addresses a process listens on."""

from __future__ import annotations

import itertools
import os
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from bench.fleet import LocalFleet

WORKER_HEADER = "x-smg-routed-worker-id"
_CONVERSATIONS = itertools.count()


def auth(fleet: LocalFleet) -> dict[str, str]:
    """What a client sends: the client key."""
    return {"Authorization": f"Bearer {fleet.api_key}"}


def admin_auth(fleet: LocalFleet) -> dict[str, str]:
    """What an operator (and the router, to the replicas) sends: the admin key."""
    return {"Authorization": f"Bearer {fleet.admin_key}"}


def openai_client(url: str, api_key: str, timeout: float = 120.0) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=timeout)


def system_prompt() -> str:
    """A long system prompt no other test uses, so no replica has it cached yet."""
    n = next(_CONVERSATIONS)
    return f"Conversation {n} at {time.time_ns()}. " + "You answer briefly and politely. " * 12


def chat_rounds(client: openai.OpenAI, model: str, rounds: int) -> list[tuple[str, Any]]:
    """A multi-turn conversation; each round resends the history. (worker, usage) per round."""
    messages: list[dict[str, str]] = [{"role": "system", "content": system_prompt()}]
    seen = []
    for turn in range(rounds):
        messages.append({"role": "user", "content": f"Question {turn}: name a colour."})
        raw = client.chat.completions.with_raw_response.create(
            model=model,
            messages=messages,
            max_tokens=4,
            temperature=0,  # type: ignore[arg-type]
        )
        reply = raw.parse()
        seen.append((raw.headers[WORKER_HEADER], reply.usage))
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    return seen


def replica_loads(url: str, fleet: LocalFleet) -> dict[str, Any]:
    response = httpx.get(url + "/v1/loads", headers=admin_auth(fleet), timeout=10.0)
    assert response.status_code == 200, response.text
    return dict(response.json())


def router_engine_load(fleet: LocalFleet, worker_url: str) -> dict[str, Any] | None:
    workers = httpx.get(fleet.url + "/workers", headers=admin_auth(fleet), timeout=10.0).json()
    for worker in workers["workers"]:
        if worker["url"] == worker_url and worker.get("engine_load"):
            return dict(worker["engine_load"]["loads"][0])
    return None


def wait_until(predicate: Any, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return bool(predicate())


def listening_addresses(pid: int) -> set[str]:
    """``ip:port`` of every TCP socket process ``pid`` listens on (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hex_ip, hex_port = local.split(":")
            if width == 8:
                ip = socket.inet_ntop(socket.AF_INET, bytes.fromhex(hex_ip)[::-1])
            else:
                ip = hex_ip
            found.add(f"{ip}:{int(hex_port, 16)}")
    return found


def requests_finished(url: str, fleet: LocalFleet) -> float:
    text = httpx.get(url + "/metrics", headers=admin_auth(fleet), timeout=10.0).text
    for line in text.splitlines():
        if line.startswith("hiserve:requests_finished_total "):
            return float(line.split()[-1])
    raise AssertionError(f"no hiserve:requests_finished_total at {url}")
