"""How a step's outputs cross the pipe of ``--engine-process``: most of them as three
fields, not as a whole ``RequestOutput``.

An output in the middle of a request (not its last, no logprobs, no error) differs from
the request's previous output only in its new tokens and text: the cache figures, the
arrival and first-token times stay as they were. Pickled whole it is ~180 bytes and costs
~2 us to dump and ~2.5 us to load (19 fields, a nested dataclass) on each side of the pipe,
per token, on the two processes whose host time bounds a GPU's served tokens/s. Such an
output crosses as ``(request_id, new_token_ids, new_text)`` (~50 bytes, ~0.5 us each way
with the encoding and the rebuilding; ``python -m bench.micro.output_wire``) and the
server's side rebuilds it from the last whole output it received for the request,
so what ``AsyncEngine`` sees is the same ``RequestOutput`` either way. Any other output
(a request's first, its last, one with logprobs or an error, one whose cache figures
changed: a retracted request that was admitted again) crosses whole and becomes the
request's template; the last output of a request drops its template on both sides.

Outputs cross without ``prompt_token_ids`` (the server's side has every prompt it sent).
"""

from __future__ import annotations

from typing import Any

from engine.request import RequestOutput

# What a compact output leaves out: equal to the request's last whole output's. The other
# fields of an output that is not a request's last are the same on all of them (no totals,
# no finish reason or error) or rule the compact form out (logprobs): NON_FINAL_CONSTANT.
Fixed = tuple[Any, ...]
NON_FINAL_CONSTANT = ("token_ids", "text", "finished", "finish_reason", "logprobs", "error")
Compact = tuple[str, list[int], str]


def _fixed(out: RequestOutput) -> Fixed:
    return (
        out.cached_tokens,
        out.cached_tokens_device,
        out.cached_tokens_host,
        out.cached_tokens_storage,
        out.cache_miss_reasons,  # frozen: replaced, never changed in place
        out.stop_reason,
        out.first_token_time,
        out.arrival_time,
    )


class OutputEncoder:
    """The engine process's side: what goes on the wire for each output."""

    def __init__(self) -> None:
        self._sent: dict[str, Fixed] = {}  # request id -> its last whole output's fixed part

    def encode(self, outputs: list[RequestOutput]) -> list[RequestOutput | Compact]:
        wire: list[RequestOutput | Compact] = []
        sent = self._sent
        for out in outputs:
            rid = out.request_id
            if out.finished:
                sent.pop(rid, None)
            elif out.new_logprobs is None and out.prompt_logprobs is None:
                fixed = _fixed(out)
                if sent.get(rid) == fixed:
                    wire.append((rid, out.new_token_ids, out.new_text))
                    continue
                sent[rid] = fixed
            else:
                sent.pop(rid, None)  # logprobs: whole, and no template from it
            out.prompt_token_ids = []
            wire.append(out)
        return wire


class OutputDecoder:
    """The server's side: ``RequestOutput``s again, their prompts put back."""

    def __init__(self, prompts: dict[str, list[int]]) -> None:
        self._prompts = prompts  # request id -> prompt, until its last output
        self._templates: dict[str, dict[str, Any]] = {}  # request id -> last whole output

    def decode(self, wire: list[RequestOutput | Compact]) -> list[RequestOutput]:
        outputs = []
        new = object.__new__
        for item in wire:
            if isinstance(item, tuple):
                rid, ids, text = item
                out = new(RequestOutput)
                fields = out.__dict__
                fields.update(self._templates[rid])
                fields["new_token_ids"] = ids
                fields["new_text"] = text
            else:
                out = item
                rid = out.request_id
                if out.finished:
                    self._templates.pop(rid, None)
                    out.prompt_token_ids = self._prompts.pop(rid, [])
                else:
                    out.prompt_token_ids = self._prompts.get(rid) or []
                    self._templates[rid] = dict(out.__dict__)  # a copy: readers own `out`
            outputs.append(out)
        return outputs
