"""Command-line and environment arguments of the server.

Every EngineConfig field has a flag (``kv_cache_tokens`` -> ``--kv-cache-tokens``), and
every flag can also come from ``HISERVE_<FLAG_UPPER_SNAKE>`` (``HISERVE_KV_CACHE_TOKENS``).
The command line beats the environment, which beats the EngineConfig default.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from typing import Any, NoReturn

from engine.config import L3_DEFAULT_PAGE_SIZE, EngineConfig
from server.flag_spec import ENV_PREFIX, FALSE_WORDS, NONE_WORDS, TRUE_WORDS, FlagSpec
from server.flags import FLAG_TABLE

__all__ = ["ENV_PREFIX", "FLAG_TABLE", "FlagSpec", "ServerArgs", "build_parser", "parse_args"]


@dataclass(frozen=True)
class ServerArgs:
    """Effective server configuration: the engine's part plus the HTTP part."""

    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    fd: int | None = None
    api_key: str | None = None
    admin_key: str | None = None
    metrics_public: bool = False
    log_level: str = "info"
    max_body_bytes: int = 8 * 1024 * 1024
    max_connections: int = 4096
    max_connections_per_client: int = 256
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    send_timeout: float = 15.0
    send_buffer_bytes: int = 64 * 1024
    shutdown_grace: float = 30.0
    max_choices: int = 256
    max_choice_prompt_tokens: int = 131072
    allowed_hosts: tuple[str, ...] = ()  # empty: any Host header
    enable_docs: bool = False
    trust_message_special_tokens: bool = False
    tool_call_parser: str = "auto"
    # Settings the server chose for the operator, one sentence each, for the start-up log.
    notes: tuple[str, ...] = ()
    cached_tokens_scope: str = "all"  # what cached_tokens reports (server/cache_report.py)
    require_cache_salt: bool = False  # requests without a cache_salt get a 400
    cache_salt_from_key: bool = False  # the bearer token salts the cache too

    def summary(self) -> dict[str, Any]:
        """Flat view for the startup line; the API key is never shown."""
        out = self.engine.to_dict()
        out.update(
            host=self.host,
            port=self.port,
            fd=self.fd,
            log_level=self.log_level,
            api_key="set" if self.api_key else "none",
            admin_key="set" if self.admin_key else "none",
            metrics_public=self.metrics_public,
            max_body_bytes=self.max_body_bytes,
            max_connections=self.max_connections,
            max_connections_per_client=self.max_connections_per_client,
            header_timeout=self.header_timeout,
            body_timeout=self.body_timeout,
            send_timeout=self.send_timeout,
            send_buffer_bytes=self.send_buffer_bytes,
            shutdown_grace=self.shutdown_grace,
            max_choices=self.max_choices,
            max_choice_prompt_tokens=self.max_choice_prompt_tokens,
            allowed_hosts=",".join(self.allowed_hosts) or "any",
            enable_docs=self.enable_docs,
            trust_message_special_tokens=self.trust_message_special_tokens,
            tool_call_parser=self.tool_call_parser,
            cached_tokens_scope=self.cached_tokens_scope,
            require_cache_salt=self.require_cache_salt,
            cache_salt_from_key=self.cache_salt_from_key,
        )
        return out


# --allowed-hosts of a server without any key: the names of this machine's loopback.
LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]")

_FIELDS = {f.name: f for f in fields(EngineConfig)}


def _resolve(spec: FlagSpec) -> tuple[str, bool, Any]:
    """(kind, optional, default) of a flag, read from the EngineConfig field when it has one."""
    if spec.field is None:
        assert spec.kind is not None
        return spec.kind, spec.optional, spec.default
    f = _FIELDS[spec.field]
    parts = [p.strip() for p in str(f.type).split("|")]
    optional = "None" in parts
    kinds = [p for p in parts if p != "None"]
    if len(kinds) != 1 or kinds[0] not in ("str", "int", "float", "bool"):
        raise TypeError(f"EngineConfig.{f.name} has unsupported type {f.type!r}")
    default = f.default if f.default is not MISSING else None
    if spec.invert and default is not None:  # None: auto, left to the engine
        default = not default
    return kinds[0], optional, default


def _bool(text: str) -> bool:
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"expected one of {'/'.join(TRUE_WORDS + FALSE_WORDS)}, got {text!r}")


def _converter(kind: str, optional: bool) -> Callable[[str], Any]:
    converters: dict[str, Callable[[str], Any]] = {
        "str": str,
        "int": int,
        "float": float,
        "bool": _bool,
    }
    base = converters[kind]

    def convert(text: str) -> Any:
        if optional and kind != "str" and text.strip().lower() in NONE_WORDS:
            return None
        return base(text)

    convert.__name__ = kind  # argparse names the type in its error messages
    return convert


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser; every default is None so that unset flags can fall back to env."""
    parser = argparse.ArgumentParser(
        prog="hiserve",
        description="OpenAI-compatible LLM server. Every flag can also be set through the "
        f"environment as {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}KV_CACHE_TOKENS=4096); "
        "flags given on the command line win.",
    )
    for spec in FLAG_TABLE:
        kind, optional, default = _resolve(spec)
        help_text = f"{spec.help} (default: {default}; env {spec.env})"
        names = [f"--{name}" for name in (spec.flag, *spec.aliases)]
        if kind == "bool":
            parser.add_argument(
                *names,
                dest=spec.dest,
                default=None,
                action=argparse.BooleanOptionalAction,
                help=help_text,
            )
        else:
            parser.add_argument(
                *names,
                dest=spec.dest,
                default=None,
                type=_converter(kind, optional),
                choices=spec.choices,
                metavar=None if spec.choices else spec.dest.upper(),
                help=help_text,
            )
    return parser


def _fail(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    parser.error(message)


def parse_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> ServerArgs:
    """Parse flags, then the environment; exit with status 2 and a clear message on errors."""
    environ = os.environ if environ is None else environ
    parser = build_parser()
    namespace = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    values: dict[str, Any] = {}
    given: set[str] = set()
    for spec in FLAG_TABLE:
        kind, optional, default = _resolve(spec)
        value = getattr(namespace, spec.dest)
        raw = environ.get(spec.env)
        if value is None and raw is not None and raw.strip() != "":
            try:
                value = _converter(kind, optional)(raw)
            except ValueError as exc:
                _fail(parser, f"environment variable {spec.env}={raw!r}: invalid {kind} ({exc})")
            if spec.choices is not None and value not in spec.choices:
                _fail(
                    parser,
                    f"environment variable {spec.env}={raw!r}: choose one of "
                    f"{', '.join(spec.choices)}",
                )
        values[spec.dest] = default if value is None else value
        if value is not None:
            given.add(spec.dest)

    notes = _derive_l3_page_size(values, given)
    engine_kwargs: dict[str, Any] = {}
    for spec in FLAG_TABLE:
        if spec.field is not None:
            value = values[spec.dest]
            engine_kwargs[spec.field] = (not value) if spec.invert and value is not None else value
    try:
        engine = EngineConfig(**engine_kwargs)
    except ValueError as exc:
        _fail(parser, f"invalid engine configuration: {exc}")
    if not 0 <= values["port"] <= 65535:
        _fail(parser, f"--port must be in [0, 65535], got {values['port']}")
    if values["fd"] is not None and values["fd"] < 0:
        _fail(parser, f"--fd must be an open file descriptor (>= 0), got {values['fd']}")
    if values["max_body_bytes"] < 1024:
        _fail(parser, f"--max-body-bytes must be >= 1024, got {values['max_body_bytes']}")
    if values["shutdown_grace"] < 0:
        _fail(parser, f"--shutdown-grace must be >= 0, got {values['shutdown_grace']}")
    if values["max_choices"] < 1:
        _fail(parser, f"--max-choices must be >= 1, got {values['max_choices']}")
    for name in (
        "max_choice_prompt_tokens",
        "max_connections",
        "header_timeout",
        "body_timeout",
        "send_timeout",
    ):
        if values[name] <= 0:
            _fail(parser, f"--{name.replace('_', '-')} must be > 0, got {values[name]}")
    for name in ("max_connections_per_client", "send_buffer_bytes"):
        if values[name] < 0:
            _fail(parser, f"--{name.replace('_', '-')} must be >= 0 (0: off), got {values[name]}")
    api_key = values["api_key"] or None
    admin_key = values["admin_key"] or None
    if api_key is not None and api_key == admin_key:
        _fail(parser, "--admin-key must differ from --api-key (clients must not hold it)")
    hosts = parse_hosts(values["allowed_hosts"])
    if not hosts and api_key is None and admin_key is None:
        # NOTE: a keyless server answers any page a browser loads; a DNS-rebinding page
        # reaches it under its own host name. Loopback names only, unless asked.
        hosts = LOCAL_HOSTS
    return ServerArgs(
        engine=engine,
        host=values["host"],
        port=values["port"],
        fd=values["fd"],
        api_key=api_key,
        admin_key=admin_key,
        metrics_public=bool(values["metrics_public"]),
        log_level=values["log_level"],
        max_body_bytes=values["max_body_bytes"],
        max_connections=values["max_connections"],
        max_connections_per_client=values["max_connections_per_client"],
        header_timeout=values["header_timeout"],
        body_timeout=values["body_timeout"],
        send_timeout=values["send_timeout"],
        send_buffer_bytes=values["send_buffer_bytes"],
        shutdown_grace=values["shutdown_grace"],
        max_choices=values["max_choices"],
        max_choice_prompt_tokens=values["max_choice_prompt_tokens"],
        allowed_hosts=hosts,
        enable_docs=bool(values["enable_docs"]),
        trust_message_special_tokens=bool(values["trust_message_special_tokens"]),
        tool_call_parser=values["tool_call_parser"],
        notes=tuple(notes),
        cached_tokens_scope=values["cached_tokens_scope"],
        require_cache_salt=bool(values["require_cache_salt"]),
        cache_salt_from_key=bool(values["cache_salt_from_key"]),
    )


def _derive_l3_page_size(values: dict[str, Any], given: set[str]) -> list[str]:
    """An L3 backend with no page size given gets one that suits L3 (the store keeps one
    object per page); a page size the operator gave is kept, and checked as given."""
    backend = values.get("hicache_storage_backend")
    if backend in (None, "none") or "page_size" in given:
        return []
    values["page_size"] = L3_DEFAULT_PAGE_SIZE
    return [
        f"page size {L3_DEFAULT_PAGE_SIZE} tokens: the L3 storage backend {backend!r} keeps "
        "one object per KV page and no --page-size was given (set it to choose another)"
    ]


def parse_hosts(text: str | None) -> tuple[str, ...]:
    """``"a.example, 127.0.0.1"`` -> ``("a.example", "127.0.0.1")``, lower-cased."""
    if not text:
        return ()
    return tuple(h.strip().lower() for h in text.split(",") if h.strip())
