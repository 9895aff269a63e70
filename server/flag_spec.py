"""One row of the server's flag table (server/flags.py): the flag, the EngineConfig field
it sets, and how its value is read, from the command line or from its ``HISERVE_``
environment variable (server/args.py applies these rules)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "HISERVE_"
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
# Optional numbers also accept these words for "unset"; optional strings are unset when empty.
NONE_WORDS = ("none", "null", "auto")


@dataclass(frozen=True)
class FlagSpec:
    """One command-line flag: which EngineConfig field it sets (if any) and how."""

    flag: str  # without the leading dashes
    help: str
    field: str | None = None  # EngineConfig field; None: a server-only flag
    kind: str | None = None  # "str" | "int" | "float" | "bool"; None: from the field type
    optional: bool = False  # accepts None ("none"); taken from the field type when set
    default: Any = None  # server-only flags only
    choices: tuple[str, ...] | None = None
    invert: bool = False  # the flag sets the field to the opposite boolean
    aliases: tuple[str, ...] = ()  # other spellings of the flag (without dashes)

    @property
    def dest(self) -> str:
        return self.flag.replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()
