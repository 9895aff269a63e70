"""The router image's entrypoint: starts smg with its keys kept off the command line.

smg 1.13.0 takes its keys only as flags (``--api-key``, ``--tenant-api-key``,
``--control-plane-api-keys``); it reads none from the environment or a file, so a key
given that way is in the process's argv, which ``ps`` shows to every user of the host
until smg renames its process. This script reads the keys from files (Docker or
Kubernetes secrets) or environment variables, adds the key flags to the arguments it
hands to smg's own parser *inside this process*, and runs the router in this process.
argv never holds a key, at any moment.

    ROUTER_ADMIN_KEY_FILE / ROUTER_ADMIN_KEY   the fleet's admin key: what the router
        sends to the replicas (their admin key) and the only key of the router's
        control plane (/workers, /flush_cache)
    ROUTER_API_KEY_FILE / ROUTER_API_KEY       the clients' key (serving routes only)
    ROUTER_WORKER_URLS                         replica URLs, space-separated (optional)

A ``*_FILE`` variable names a file holding the key (surrounding whitespace is dropped);
setting both forms of one key is refused. Without an admin key, the client key is the
router's only key and also opens its admin routes (a warning says so). Key flags on the
command line are refused: that is the leak this script exists to avoid.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

KEY_FLAGS = ("--api-key", "--tenant-api-key", "--control-plane-api-keys")
ADMIN_KEY_ID = "fleet-admin:fleet admin:admin"
CLIENT_TENANT = "clients"


class LaunchError(RuntimeError):
    """A setting the launcher refuses; the message says which and why."""


def read_key(environ: Mapping[str, str], name: str) -> str:
    """The key named ``name`` from ``name``_FILE or ``name``; empty when neither is set."""
    path, value = environ.get(f"{name}_FILE", ""), environ.get(name, "")
    if path and value:
        raise LaunchError(f"set {name} or {name}_FILE, not both")
    if not path:
        return value.strip()
    try:
        key = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise LaunchError(f"{name}_FILE: cannot read {path}: {exc.strerror}") from None
    if not key:
        raise LaunchError(f"{name}_FILE: {path} is empty")
    return key


def key_flags(client_key: str, admin_key: str) -> tuple[list[str], str | None]:
    """smg's key flags for these keys, and a warning to print (or None)."""
    if admin_key:
        flags = ["--api-key", admin_key, "--control-plane-api-keys", f"{ADMIN_KEY_ID}:{admin_key}"]
        if client_key:
            flags += ["--tenant-api-key", f"{CLIENT_TENANT}:{client_key}"]
        return flags, None
    if client_key:
        warning = "WARNING: without an admin key the client key opens the router's admin routes"
        return ["--api-key", client_key], warning
    return [], None


def router_argv(argv: Sequence[str], environ: Mapping[str, str]) -> tuple[list[str], str | None]:
    """The full argument list for smg's parser (keys included), and a warning or None."""
    for arg in argv:
        if arg.split("=", 1)[0] in KEY_FLAGS:
            raise LaunchError(
                f"{arg.split('=', 1)[0]} on the command line would show the key to `ps`: "
                "give it as ROUTER_ADMIN_KEY[_FILE] / ROUTER_API_KEY[_FILE] instead"
            )
    full = list(argv)
    urls = environ.get("ROUTER_WORKER_URLS", "").split()
    if urls:
        full += ["--worker-urls", *urls]
    flags, warning = key_flags(
        read_key(environ, "ROUTER_API_KEY"), read_key(environ, "ROUTER_ADMIN_KEY")
    )
    return full + flags, warning


def parse(argv: Sequence[str], environ: Mapping[str, str]) -> tuple[Any, str | None]:
    """smg's RouterArgs for this command line and environment (smg's own parser)."""
    from smg.launch_router import parse_router_args

    full, warning = router_argv(argv, environ)
    return parse_router_args(full), warning


def main(
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    launch: Callable[[Any], None] | None = None,
) -> int:
    environ = os.environ if environ is None else environ
    try:
        router_args, warning = parse(sys.argv[1:] if argv is None else argv, environ)
    except LaunchError as exc:
        print(f"router launcher: {exc}", file=sys.stderr)
        return 2
    if warning:
        print(warning, file=sys.stderr)
    # The keys now live in router_args only: the replicas' children need none of them.
    for name in ("ROUTER_API_KEY", "ROUTER_ADMIN_KEY"):
        os.environ.pop(name, None)
    if launch is None:
        from smg.launch_router import launch_router as launch
    launch(router_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
