"""Per-request state: sampling parameters, the request itself, and what it outputs."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.cache_salt import check_cache_salt
from engine.errors import InvalidRequestError
from engine.grammar_spec import GrammarSpec
from engine.kvcache.miss_reasons import MissReasons

if TYPE_CHECKING:
    from engine.detokenizer import IncrementalDetokenizer


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # aborted by the client or the engine


@dataclass
class SamplingParams:
    """How to pick tokens for one request (OpenAI fields plus vLLM/SGLang extras)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    # A set: membership is checked once per generated token; one object shared by every
    # choice of an n > 1 request (frozenset() of a frozenset is the same object).
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    ignore_eos: bool = False
    min_tokens: int = 0
    # OpenAI's logit_bias: (token id, bias in [-100, 100]) pairs added to the logits before
    # sampling, distinct ids. A tuple: cheap to walk each step, picklable, and one object
    # shared by every choice of an n > 1 request (a mapping given here becomes one).
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # top-N alternatives per generated token; 0: chosen only
    # Prompt scoring: the logprob of every prompt token given its prefix, with top-N
    # alternatives (0: the prompt token only). None: the prompt is not scored.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    grammar: GrammarSpec | None = None  # structured output: the text must match it
    # The API request this engine request is one copy of (n > 1, or several prompts): the
    # scheduler takes turns between groups instead of admitting a whole group first.
    group: str | None = None
    # The tenant whose cached KV this request may reuse (engine/cache_salt.py); None:
    # the unsalted cache. Not a sampling setting, but it travels with every copy.
    cache_salt: str | None = None
    # Who sent it (the server sets the peer address): when admission runs out of room,
    # each client with work keeps a fair share of the running requests
    # (engine/client_share.py). None: one shared client, as for the engine's own API.
    client: str | None = None
    # Whether the caller reads the output as it comes (a stream). False: after the
    # first token's output (its time to first token), nothing until the final one, which
    # carries every delta since; the outputs in between would only be thrown away.
    stream: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = frozenset(self.stop_token_ids or ())
        if not isinstance(self.logit_bias, tuple):
            self.logit_bias = tuple(dict(self.logit_bias or {}).items())

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    def validate(
        self,
        vocab_size: int,
        max_stop_strings: int = 16,
        max_stop_token_ids: int = 256,
        max_logprobs: int = 20,
        max_stop_chars: int = 512,
        max_logit_bias: int = 300,
    ) -> None:
        """Raise InvalidRequestError naming the offending field; every check is cheap (the lengths
        are bounded before anything walks a list)."""
        check_cache_salt(self.cache_salt)
        # max_tokens 0 only scores the prompt: it needs prompt_logprobs to mean anything.
        least = 0 if self.prompt_logprobs is not None else 1
        if not isinstance(self.max_tokens, int) or self.max_tokens < least:
            raise InvalidRequestError(
                f"max_tokens must be an integer >= {least}, got {self.max_tokens!r}"
                + ("" if least == 0 else " (0 only when the prompt is scored)"),
                param="max_tokens",
            )
        if self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be >= 0, got {self.temperature}", param="temperature"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if self.top_k < -1:
            raise InvalidRequestError(
                f"top_k must be -1 (disabled) or >= 1, got {self.top_k}", param="top_k"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", param="min_p")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise InvalidRequestError(
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
                param="presence_penalty",
            )
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise InvalidRequestError(
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
                param="frequency_penalty",
            )
        if self.repetition_penalty <= 0:
            raise InvalidRequestError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
                param="repetition_penalty",
            )
        if len(self.stop) > max_stop_strings:
            raise InvalidRequestError(
                f"stop has {len(self.stop)} strings; at most {max_stop_strings} are allowed",
                param="stop",
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings", param="stop")
        longest = max((len(s) for s in self.stop), default=0)
        if longest > max_stop_chars:
            raise InvalidRequestError(
                f"stop strings may be at most {max_stop_chars} characters long "
                f"(--max-stop-chars); one has {longest}",
                param="stop",
            )
        if len(self.stop_token_ids) > max_stop_token_ids:
            raise InvalidRequestError(
                f"stop_token_ids has {len(self.stop_token_ids)} ids; at most "
                f"{max_stop_token_ids} are allowed (--max-stop-token-ids)",
                param="stop_token_ids",
            )
        bad = sorted(t for t in self.stop_token_ids if not 0 <= t < vocab_size)
        if bad:
            raise InvalidRequestError(
                f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
                param="stop_token_ids",
            )
        self._validate_logit_bias(vocab_size, max_logit_bias)
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
                param="min_tokens",
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= max_logprobs:
            raise InvalidRequestError(
                f"logprobs must be in [0, {max_logprobs}] (--max-logprobs), got {self.logprobs}",
                param="logprobs",
            )
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= max_logprobs:
            raise InvalidRequestError(
                f"prompt_logprobs must be in [0, {max_logprobs}] (--max-logprobs), "
                f"got {self.prompt_logprobs}",
                param="prompt_logprobs",
            )

    def _validate_logit_bias(self, vocab_size: int, max_logit_bias: int) -> None:
        entries = self.logit_bias
        if len(entries) > max_logit_bias:
            raise InvalidRequestError(
                f"logit_bias has {len(entries)} entries; at most {max_logit_bias} are allowed "
                "(--max-logit-bias)",
                param="logit_bias",
            )
        if not all(isinstance(e, tuple) and len(e) == 2 for e in entries):
            raise InvalidRequestError(
                "logit_bias must be (token id, bias) pairs", param="logit_bias"
            )
        ids = [t for t, _ in entries]
        bad = [t for t in ids if not _is_int(t) or not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids in the vocabulary [0, {vocab_size}); "
                f"got {bad[:5]}",
                param="logit_bias",
            )
        if len(set(ids)) < len(ids):
            raise InvalidRequestError(
                "logit_bias names a token id more than once", param="logit_bias"
            )
        # NOTE: the range check also refuses NaN and infinities (no comparison holds).
        wrong = [b for _, b in entries if not _is_number(b) or not -100 <= b <= 100]
        if wrong:
            raise InvalidRequestError(
                f"logit_bias values must be numbers in [-100, 100], got {wrong[:5]}",
                param="logit_bias",
            )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass
class TokenLogprob:
    """Log-probability of one generated token and its top alternatives."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)  # token id -> logprob
    rank: int | None = None  # 1 + how many tokens were likelier (prompt tokens only)


@dataclass
class RequestOutput:
    """What one engine step changed for a request: the deltas, plus (on the final output
    only) the totals."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # final output: every generated token; otherwise empty
    text: str  # final output: the generated text (a stop string cut off); otherwise ""
    new_token_ids: list[int]  # tokens added since the previous output
    new_text: str  # text added since the previous output (never a partial UTF-8 char)
    finished: bool
    finish_reason: str | None
    cached_tokens: int  # prompt tokens served from the prefix cache (every tier)
    cached_tokens_device: int
    cached_tokens_host: int
    cached_tokens_storage: int = 0  # read from the L3 store, then loaded back
    # Why the uncached prompt tokens missed: cached_tokens + its total == prompt tokens.
    cache_miss_reasons: MissReasons = field(default_factory=MissReasons)
    logprobs: list[TokenLogprob] | None = None  # final output: all of them, when requested
    new_logprobs: list[TokenLogprob] | None = None
    # A scored prompt: None for its first token, then one entry per prompt token. On the
    # first output after the prompt was scored and on the final one; None on the others.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    stop_reason: int | str | None = None  # matched stop string or stop token id
    first_token_time: float | None = None
    arrival_time: float = 0.0
    # Why the engine ended the request early (finish_reason "abort"): a ValueError is the
    # request's fault (a constraint that does not compile), anything else the server's.
    error: Exception | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class ReqStatus(str, enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    """Engine-side state of one request.

    NOTE: KV ownership of a running request, by index range of ``all_ids``:
      [0, prefix_len)            slots of matched tree nodes (locked via ``last_node``);
      [prefix_len, kv_len)       slots this request allocated and owns;
      [kv_len, seq_len)          tokens whose KV is not computed yet.
    ``seq_len`` also counts ``future_ids``: tokens the overlapped loop sampled that are
    still on their way to the host (``all_ids`` and ``output_ids`` hold only tokens the
    host has, so they are never longer than ``seq_len``).
    On finish the owned range is handed to the tree (or freed) and the lock released.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    # Sampled tokens not on the host yet, oldest first: indices into FutureTokens.
    future_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    # KV bookkeeping (owned by the scheduler)
    row: int = -1  # row in the request table; -1 when not running
    kv_len: int = 0  # tokens whose KV is in the device pool
    prefix_len: int = 0  # tokens of kv_len held by locked tree nodes
    last_node: Any = None  # deepest locked tree node
    # Digest of params.cache_salt ("" without one): the caches key this request by it.
    cache_salt: str = ""
    # Reporting (first admission only: a retracted request keeps its first numbers)
    cached_device: int = 0
    cached_host: int = 0
    cached_storage: int = 0  # prompt tokens read from the L3 store (then loaded back)
    # Why the rest of the prompt missed (engine/kvcache/miss_reasons.py): cached_* plus
    # these add up to the prompt tokens.
    miss_reasons: MissReasons = field(default_factory=MissReasons)
    reported_cache: bool = False
    num_retractions: int = 0
    # Its stream's reader is behind (engine/async_engine.py): it is not decoded nor
    # admitted until the reader catches up; its KV waits in the prefix tree.
    reader_behind: bool = False
    arrival_seq: int = 0  # order of arrival at the scheduler
    times_passed: int = 0  # prefill steps that admitted a later arrival while this waited
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    admit_time: float | None = None  # first admission: when its cache hits were decided
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # Scored prompt tokens 1.. so far (entry i: prompt token i + 1, from position i).
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    sent_prompt_logprobs: bool = False
    detok: IncrementalDetokenizer | None = None
    # The output's text is "".join(text_head) + text: ``text`` keeps the characters a
    # stop string may still reach and, while the request streams, what is not sent yet;
    # the rest moves to ``text_head`` (outputs.check_stop), since appending to one string
    # as long as the output copies all of it at every token.
    text: str = ""
    text_head: list[str] = field(default_factory=list)
    head_chars: int = 0  # characters in text_head
    sent_tokens: int = 0  # output tokens already reported
    sent_text: int = 0  # characters of the whole text already reported
    sent_logprobs: int = 0
    generator: Any = None  # torch.Generator for seeded sampling
    stop_checker: Any = None  # detokenizer.StopChecker, built on first use
    grammar: Any = None  # grammar.RequestGrammar of a constrained request (engine thread)
    error: Exception | None = None  # set when the engine ends the request on an error

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + len(self.future_ids)

    @property
    def finished(self) -> bool:
        return self.status == ReqStatus.FINISHED

    @property
    def scoring_prompt(self) -> bool:
        """Whether prompt positions still need logits: such a request computes its whole
        prompt (the prefix cache keeps KV, not the logits scoring needs)."""
        return (
            self.params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < len(self.prompt_ids) - 1
        )

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - len(self.output_ids) - len(self.future_ids)
