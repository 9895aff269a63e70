"""The error a request the engine refuses raises: its message says what is wrong and what
to do, and ``param`` names the request field at fault, so the server never reads the
field back out of the text."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine cannot run as asked; ``param``: the field at fault, or None
    where no single field is (``"prompt"`` stands for whatever carried the prompt)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
