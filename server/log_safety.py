"""What the logs may say: credentials out of logged URLs, and a warning when exposed."""

from __future__ import annotations

import ipaddress
import logging
import re
from typing import Any

logger = logging.getLogger("hiserve.server")

# Query parameters whose values are credentials (matched case-insensitively, as a
# substring: "api_key", "x-api-key", "access_token", "client_secret", ...).
_SECRET_PARAM = re.compile(
    r"(?i)([?&][^=&#\s]*(?:key|token|bearer|secret|password|passwd|auth|signature|sig)[^=&#\s]*=)"
    r"[^&#\s]*"
)
# user:password@ in a URL.
_USERINFO = re.compile(r"(?i)(\b[a-z][a-z0-9+.-]*://)[^/@\s]+@")
REDACTED = "***"


def redact_url(text: str) -> str:
    """``/v1/models?api_key=sk-1&x=2`` -> ``/v1/models?api_key=***&x=2``."""
    text = _SECRET_PARAM.sub(lambda m: m.group(1) + REDACTED, text)
    return _USERINFO.sub(lambda m: m.group(1) + REDACTED + "@", text)


class RedactingFilter(logging.Filter):
    """Redacts credentials in a record's string arguments (uvicorn's access log passes
    the full path with its query string as one of them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args: Any = record.args
        if isinstance(args, tuple):
            record.args = tuple(redact_url(a) if isinstance(a, str) else a for a in args)
        elif isinstance(record.msg, str) and not args:
            record.msg = redact_url(record.msg)
        return True


def install_redaction(names: tuple[str, ...] = ("uvicorn.access", "uvicorn.error")) -> None:
    """Add the filter to ``names`` once (idempotent: apps built twice in one process)."""
    for name in names:
        target = logging.getLogger(name)
        if not any(isinstance(f, RedactingFilter) for f in target.filters):
            target.addFilter(RedactingFilter())


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server reachable from this machine only."""
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a host name other than localhost: assume it resolves outward


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning to log when serving beyond loopback without a key; None when safe."""
    if api_key or is_loopback(host):
        return None
    return (
        f"serving on {host}, which is reachable from other machines, WITHOUT an API key: "
        "anyone who reaches this port can run completions and flush the cache. "
        "Set --api-key (HISERVE_API_KEY) or listen on 127.0.0.1."
    )
