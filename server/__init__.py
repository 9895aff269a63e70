"""hiserve HTTP front end: an OpenAI-compatible API over the engine (``python -m server``)."""

from __future__ import annotations
