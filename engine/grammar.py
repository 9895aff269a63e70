"""Structured outputs: the grammar backend (xgrammar), per-request matchers, the token mask.

One ``GrammarBackend`` per model holds the tokenizer description and the compiler with
its cache; compiles run in worker processes, never on the engine thread. Each constrained
request owns a ``RequestGrammar`` (engine/grammar_matcher.py: its compile future, then
its matcher), touched only by the engine thread. ``TokenMasker`` fills one bitmask row per constrained request and
applies it to the logits before any other sampling step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.grammar_matcher import DEFAULT_STEP_BUDGET_S, RequestGrammar
from engine.grammar_pool import DEFAULT_CACHE_BYTES, CompilePool
from engine.grammar_spec import GrammarError, GrammarSpec, check_spec
from engine.host_alloc import pinned_empty

if TYPE_CHECKING:
    from engine.request import Req

logger = logging.getLogger("hiserve.grammar")

# How long a request may wait for its grammar to compile before it fails.
DEFAULT_COMPILE_TIMEOUT_S = 30.0
# A request may wait this many compile timeouts for a worker to take its constraint: the
# workers kill every compile at one timeout, so a queue behind slow constraints drains,
# and a small constraint queued behind them must not fail for their slowness.
QUEUE_WAIT_TIMEOUTS = 4


def xgrammar_available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


def build_tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Collection[int]) -> Any:
    """xgrammar's view of the vocabulary, ``vocab_size`` wide (the LM head's rows).

    NOTE: every special token is given an empty string, which xgrammar treats as never
    allowed inside text: otherwise a token such as ``<|im_start|>`` could be emitted in
    the middle of a JSON string (xgrammar sees only its characters). The stop ids are the
    engine's: the grammar may end exactly where the engine stops. Ids past the
    tokenizer's length (a padded LM head) have no string and are always masked.
    """
    import xgrammar as xgr

    detected = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
    )
    # A tokenizer may know more ids than the LM head has rows: those can never be sampled.
    vocab: list[bytes] = [bytes(piece) for piece in detected.decoded_vocab][:vocab_size]
    special = {
        int(i) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special
    }
    special.update(int(i) for i in getattr(tokenizer, "all_special_ids", []) or [])
    special.update(stop_token_ids)
    for token_id in special:
        if 0 <= token_id < len(vocab):
            vocab[token_id] = b""
    return xgr.TokenizerInfo(
        vocab,
        xgr.VocabType.RAW,
        vocab_size=vocab_size,
        stop_token_ids=sorted(stop_token_ids),
        add_prefix_space=False,
    )


class GrammarBackend:
    """Compiles constraints for one model, off the engine thread, each distinct one once.

    Compiles run in killable worker processes (engine/grammar_pool.py); the parse check
    runs first, here, so a constraint the engine refuses never reaches a worker.
    """

    def __init__(
        self,
        tokenizer_info: Any,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        compile_workers: int = 2,
        step_budget_s: float = DEFAULT_STEP_BUDGET_S,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        self.step_budget_s = step_budget_s
        self.info = tokenizer_info
        self.vocab_size: int = int(tokenizer_info.vocab_size)
        self.stop_token_ids: list[int] = list(tokenizer_info.stop_token_ids)
        self.compile_timeout_s = compile_timeout_s
        self.pool = CompilePool(tokenizer_info, compile_workers, compile_timeout_s, cache_bytes)

    @classmethod
    def for_tokenizer(
        cls,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Collection[int],
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        step_budget_s: float = DEFAULT_STEP_BUDGET_S,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> GrammarBackend:
        info = build_tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        return cls(info, compile_timeout_s, step_budget_s=step_budget_s, cache_bytes=cache_bytes)

    def submit(self, spec: GrammarSpec) -> Future[Any]:
        """The compiled grammar of ``spec``, compiling it in a worker unless known."""
        try:
            check_spec(spec)
        except GrammarError as exc:
            failed: Future[Any] = Future()
            failed.set_exception(exc)
            return failed
        return self.pool.submit(spec)

    def start(self, spec: GrammarSpec, extra_stop_ids: Collection[int] = ()) -> RequestGrammar:
        """A new request's grammar state; its matcher is made once the compile is done."""
        stops = sorted(set(self.stop_token_ids) | set(extra_stop_ids))
        return RequestGrammar(
            spec=spec,
            future=self.submit(spec),
            deadline=time.monotonic() + QUEUE_WAIT_TIMEOUTS * self.compile_timeout_s,
            timeout_s=self.compile_timeout_s,
            stop_token_ids=stops if extra_stop_ids else None,
            step_budget_s=self.step_budget_s,
        )

    def close(self) -> None:
        self.pool.close()


def apply_backend(device: torch.device) -> str:
    """xgrammar's apply kernel for ``device``.

    NOTE: xgrammar's "auto" picks ``torch_compile`` for devices it does not know (MUSA
    among them); torch.compile stays off there, so those get the plain-torch path.
    """
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        return "triton" if _has_triton() else "torch_native"
    return "torch_native"


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class BatchMask:
    """The bitmask rows of one sampling batch: row b of ``bitmask`` is sequence b."""

    masker: TokenMasker
    bitmask: torch.Tensor  # [B, ceil(V / 32)] int32, on the masker's device
    rows: list[int]  # rows with a grammar that restricts the next token
    may_end_rows: list[int]  # rows whose grammar may end here (min_tokens must not ban EOS)

    def apply(self, logits: torch.Tensor) -> None:
        """Set the disallowed logits of the masked rows to -inf, in place. ``logits`` [B, V]."""
        self.masker.apply(logits, self)


class TokenMasker:
    """Fills and applies the next-token bitmask of the constrained rows of a batch."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.backend = apply_backend(self.device)
        self._bitmask: torch.Tensor | None = None  # [rows, ceil(V / 32)] int32, grown on demand

    def _buffer(self, rows: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            import xgrammar as xgr

            capacity = max(rows, 2 * (self._bitmask.shape[0] if self._bitmask is not None else 4))
            self._bitmask = xgr.allocate_token_bitmask(capacity, self.vocab_size)
        return self._bitmask

    def fill(self, reqs: Sequence[Req]) -> BatchMask | None:
        """The mask of the rows of ``reqs`` that carry a ready grammar, or None if none do."""
        if not any(r.grammar is not None for r in reqs):
            return None
        bitmask = self._buffer(len(reqs))
        rows: list[int] = []
        may_end: list[int] = []
        for b, req in enumerate(reqs):
            grammar: RequestGrammar | None = req.grammar
            if grammar is None or grammar.matcher is None or grammar.terminated:
                continue
            # False: every token is allowed at this point, the row needs no mask.
            if grammar.fill(bitmask, b):
                rows.append(b)
            if grammar.may_end:
                may_end.append(b)
        if not rows and not may_end:
            return None
        batch_mask = bitmask[: len(reqs)]  # [B, ceil(V / 32)]
        return BatchMask(self, self._upload(batch_mask) if rows else batch_mask, rows, may_end)

    def _upload(self, bitmask: torch.Tensor) -> torch.Tensor:
        """``bitmask`` on the masker's device, sent before the forward: the host buffer is
        refilled next step, so it goes through a pinned staging copy and an asynchronous
        upload that the forward overlaps (nothing to send on the CPU)."""
        if self.device.type == "cpu":
            return bitmask
        staged = pinned_empty(tuple(bitmask.shape), bitmask.dtype)  # [B, ceil(V / 32)]
        staged.copy_(bitmask)
        return staged.to(self.device, non_blocking=True)

    def apply(self, logits: torch.Tensor, mask: BatchMask) -> None:
        """Set the disallowed logits of the masked rows to -inf, in place. ``logits`` [B, V]."""
        if not mask.rows:
            return
        import xgrammar as xgr

        bitmask = mask.bitmask  # already on the device (fill() sent it)
        xgr.apply_token_bitmask_inplace(
            logits,
            bitmask,
            vocab_size=min(self.vocab_size, logits.shape[1]),
            indices=mask.rows,
            backend=self.backend,  # type: ignore[arg-type]
        )


class EngineGrammars:
    """The engine's structured-output side: the backend, built once, and the queued
    requests whose grammar is still compiling (engine thread only)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Collection[int],
        compile_timeout_s: float,
        device: torch.device,
        step_budget_s: float = DEFAULT_STEP_BUDGET_S,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        self.step_budget_s = step_budget_s
        self.cache_bytes = cache_bytes
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = set(stop_token_ids)
        self.compile_timeout_s = compile_timeout_s
        self.masker = TokenMasker(vocab_size, device)
        self.waiting: list[Req] = []
        self._backend: GrammarBackend | None = None

    def prepare(self, start_timeout_s: float = 120.0) -> bool:
        """Build the backend now (about 0.5 s) if xgrammar is installed, and wait for its
        compile workers to start, so the first constrained request does not pay for
        either, and the workers' start does not take the CPU from the first requests."""
        if not xgrammar_available():
            return False
        if not self.backend.pool.wait_started(start_timeout_s):
            logger.warning(
                "grammar compile workers still starting after %.0f s; serving anyway",
                start_timeout_s,
            )
        return True

    @property
    def backend(self) -> GrammarBackend:
        if self._backend is None:
            if not xgrammar_available():
                raise GrammarError(
                    "structured outputs need xgrammar: pip install --no-deps xgrammar==0.2.8 "
                    "apache-tvm-ffi",
                    "response_format",
                )
            self._backend = GrammarBackend.for_tokenizer(
                self.tokenizer,
                self.vocab_size,
                self.stop_token_ids,
                self.compile_timeout_s,
                self.step_budget_s,
                self.cache_bytes,
            )
        return self._backend

    def poll(self) -> list[tuple[Req, GrammarError]]:
        """Give compiled grammars their matchers; the requests whose grammar failed."""
        if not self.waiting:
            return []
        now = time.monotonic()
        failed: list[tuple[Req, GrammarError]] = []
        still: list[Req] = []
        for req in self.waiting:
            if req.finished or req.grammar is None:
                continue
            error = req.grammar.poll(now)
            if error is not None:
                failed.append((req, error))
            elif not req.grammar.ready:
                still.append(req)
        self.waiting = still
        return failed

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` s for a compile in flight (none: return at once)."""
        futures = [r.grammar.future for r in self.waiting if r.grammar is not None]
        if futures:
            wait_futures(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()
