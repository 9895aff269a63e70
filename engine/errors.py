"""The errors the engine raises to its callers. A request it refuses raises
InvalidRequestError: its message says what is wrong and what to do, and ``param`` names
the request field at fault, so the server never reads the field back out of the text.
The others say why a request could not run at all (AsyncEngine's, re-exported there)."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine cannot run as asked; ``param``: the field at fault, or None
    where no single field is (``"prompt"`` stands for whatever carried the prompt)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; retry later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine loop is not running."""


class StreamStalledError(RuntimeError):
    """The reader of a stream stopped taking outputs for too long; the request was ended."""
