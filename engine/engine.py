"""Engine: add_request / step / abort over the scheduler, model runner and KV cache."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from engine.build import build_engine_parts
from engine.cache_salt import salt_digest
from engine.cache_trace import CacheTracer
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.engine_stats import EngineStats
from engine.grammar import GrammarBackend
from engine.kv_setup import KVSetup
from engine.outputs import check_stop, make_output, output_due, stop_checker_of
from engine.request import FinishReason, Req, ReqStatus, RequestOutput, SamplingParams
from engine.request_checks import check_request
from engine.sampler import SamplerOutput, make_generator
from engine.scheduled_batch import ScheduledBatch
from engine.step_loop import LaunchedStep, OverlapLoop, StepDriver, overlap_enabled

logger = logging.getLogger("hiserve.engine")

PromptType = str | list[int]


class Engine:
    """Synchronous engine; one thread drives ``step()`` (see ``AsyncEngine`` for serving)."""

    def __init__(self, config: EngineConfig | None = None, **overrides: object) -> None:
        if config is None:
            config = EngineConfig(**overrides)  # type: ignore[arg-type]
        self.config = config
        parts = build_engine_parts(config)  # every collaborator, wired through constructors
        self.device_spec = parts.device_spec
        self.device = parts.device
        self.dtype = parts.dtype
        self.weights = parts.weights
        self.model_path: Path = parts.model_path
        self.hf_config = parts.hf_config
        self.tokenizer = parts.tokenizer
        self.tp = parts.tp
        self.model = parts.model
        backend: Any = getattr(self.model, "attn_backend", None)
        self.attention_backend: str = backend.name if backend is not None else "unknown"
        self.vocab_size: int = self.hf_config.vocab_size
        self.max_model_len = parts.max_model_len
        self.served_model_name = parts.served_model_name
        self.eos_token_ids = parts.eos_token_ids
        self.stream_interval = config.stream_interval
        self.kv: KVSetup = parts.kv
        self.scheduler = parts.scheduler
        self.sampler = parts.sampler
        self.grammars = parts.grammars
        self.runner = parts.runner
        self.requests: dict[str, Req] = {}
        self.reporter = EngineStats(self.scheduler, self.kv)
        self.counters = self.reporter.counters  # totals since start, also in stats()
        self.check_invariants = False  # tests turn this on: accounting checked every step
        self.tracer = (
            CacheTracer(config.cache_trace, config.page_size) if config.cache_trace else None
        )
        # What drives steps (generate(), AsyncEngine): overlapped, or step() itself.
        self.overlap = overlap_enabled(config, self.device.type)
        self.loop: StepDriver = OverlapLoop(self) if self.overlap else self
        logger.info(
            "engine ready: model=%s device=%s dtype=%s kv_tokens=%d page_size=%d "
            "max_model_len=%d tp=%d overlap=%s",
            self.model_path,
            self.device_spec,
            str(self.dtype)[6:],
            self.kv.manager.capacity,
            config.page_size,
            self.max_model_len,
            config.tensor_parallel_size,
            self.overlap,
        )

    # ------------------------------------------------------------------ input
    def tokenize(self, prompt: PromptType) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError naming the field at fault (``prompt`` for the prompt)."""
        check_request(
            prompt_ids,
            params,
            self.config,
            self.vocab_size,
            self.max_model_len,
            self.kv.manager.capacity,
        )

    def prepare_grammar(self) -> bool:
        """Build the grammar backend now if xgrammar is installed (see EngineGrammars)."""
        return self.grammars.prepare()

    @property
    def grammar(self) -> GrammarBackend:
        """The grammar backend of this model, built on first use."""
        return self.grammars.backend

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Tokenize, validate and queue a request; its id."""
        params = params or SamplingParams()
        prompt_ids = self.tokenize(prompt)
        self.validate(prompt_ids, params)
        return self.enqueue(prompt_ids, params, request_id)

    def enqueue(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        """Queue a request that ``validate`` accepted, without checking it again (the
        AsyncEngine validates once at its boundary, on the caller's thread)."""
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = Req(request_id, prompt_ids, params, cache_salt=salt_digest(params.cache_salt))
        req.detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
        if params.seed is not None:
            req.generator = make_generator(params.seed, self.device)
        if params.grammar is not None:
            req.grammar = self.grammar.start(params.grammar, params.stop_token_ids)
        self.scheduler.add(req)
        self.requests[request_id] = req
        if req.grammar is not None:
            self.grammars.waiting.append(req)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is; its KV is released at once."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        self._finish(req, FinishReason.ABORT)
        return make_output(req, finished=True)

    def set_reader_behind(self, request_id: str, behind: bool) -> None:
        """Pause ``request_id`` while its stream's reader is behind (the scheduler retracts
        it at the next step), or let it go on."""
        req = self.requests.get(request_id)
        if req is not None:
            req.reader_behind = behind

    # ------------------------------------------------------------------ loop
    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[RequestOutput]:
        """Schedule one batch, run it, and return the outputs due: every request that
        finished, and the running ones whose new tokens go out now (``output_due``)."""
        outputs = self.drain_ended()
        batch = self.scheduler.schedule()
        if batch is None:
            if not outputs:
                self.idle()
            return outputs
        outputs.extend(self.land(self.launch(batch)))
        return outputs

    def drain_ended(self) -> list[RequestOutput]:
        """Finish the requests ended between steps: out of KV, or a failed grammar."""
        outputs: list[RequestOutput] = []
        for req in self.scheduler.out_of_memory:
            if not req.finished:  # a token that landed since may have ended it
                self._finish(req, FinishReason.LENGTH)
                outputs.append(make_output(req, finished=True))
        self.scheduler.out_of_memory.clear()
        for req, error in self.grammars.poll():
            req.error = error
            self._finish(req, FinishReason.ABORT)
            outputs.append(make_output(req, finished=True))
        return outputs

    def idle(self) -> None:
        """Nothing runnable: block briefly on compiles and L3 reads rather than spin."""
        self.grammars.wait(timeout=0.01)
        self.kv.manager.wait_prefetches(timeout=0.01)

    def launch(self, batch: ScheduledBatch, keep_future: bool = False) -> LaunchedStep:
        """Queue ``batch``'s forward and sampling. ``keep_future``: the tokens go into the
        future buffer, referenced by each sampling request until they land."""
        started = time.perf_counter()
        step = LaunchedStep(batch, self._run(batch), started)
        self.scheduler.land_prefill(batch)
        futures = self.runner.futures
        if keep_future and step.result is not None and futures is not None:
            first = futures.store(step.result.tokens)
            sampling = [r for r, s in zip(batch.reqs, batch.sample) if s]
            for i, req in enumerate(sampling):
                req.future_ids.append(first + i)
        return step

    def land(self, step: LaunchedStep) -> list[RequestOutput]:
        """Take ``step``'s tokens on the host: stops, detokenization, outputs."""
        batch, result = step.batch, step.result
        outputs = []
        if result is not None:
            outputs = self._postprocess(batch, result.token_ids, result.logprobs)
        if not batch.is_decode:
            seconds = time.perf_counter() - step.started
            self.scheduler.step_budget.observe(batch.num_prefill_tokens, seconds)
            self.reporter.log_prefill(batch, seconds)
        if self.check_invariants:
            self.kv.manager.check_invariants(self.scheduler.running)
        return outputs

    def _run(self, batch: ScheduledBatch) -> SamplerOutput | None:
        """The batch's forward and sampling. With tensor parallelism a failure here ends
        the group: the other ranks may be inside a collective rank 0 will not join."""
        try:
            return self.runner.run(batch)
        except BaseException as exc:
            if self.tp is not None:
                self.tp.fail(exc)
            raise

    def _postprocess(
        self, batch: ScheduledBatch, tokens: list[int], logprobs: Sequence[object]
    ) -> list[RequestOutput]:
        outputs = []
        sampling = [r for r, s in zip(batch.reqs, batch.sample) if s]
        now = time.monotonic()
        for req, token, lp in zip(sampling, tokens, logprobs):
            if req.future_ids:
                req.future_ids.pop(0)  # this token (launched overlapped) has landed
            if req.finished:
                continue  # ended by an earlier token or an abort: this one is dropped
            if not req.output_ids and req.num_retractions == 0:
                self.reporter.count_prompt(req)
            if req.params.max_tokens == 0:
                # Prompt scoring only: the prompt is complete and scored; drop the token.
                self._finish(req, FinishReason.LENGTH)
                outputs.append(make_output(req, finished=True))
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            req.output_ids.append(token)
            self.counters["generation_tokens_total"] += 1
            if lp is not None:
                req.logprobs.append(lp)  # type: ignore[arg-type]
            if req.grammar is not None and not req.grammar.accept(token):
                # The mask allowed only grammar tokens: this is a bug, not the request's.
                req.error = RuntimeError(
                    f"sampled token {token} is not allowed by the request's grammar"
                )
                self._finish(req, FinishReason.ABORT)
                outputs.append(make_output(req, finished=True))
                continue
            over = req.grammar.over_budget() if req.grammar is not None else None
            if over is not None:
                req.error = over  # this request only; the others in the batch go on
                self._finish(req, FinishReason.ABORT)
                outputs.append(make_output(req, finished=True))
                continue
            reason = check_stop(req, token, self.eos_token_ids, self.max_model_len)
            if req.grammar is not None and req.grammar.terminated:
                # NOTE: a completed grammar is a complete output, even at max_tokens.
                reason = FinishReason.STOP
            if reason is not None:
                self._finish(req, reason)
                outputs.append(make_output(req, finished=True))
            elif output_due(req, self.stream_interval):
                outputs.append(make_output(req, finished=False))
        return outputs

    def _finish(self, req: Req, reason: FinishReason) -> None:
        # A matched stop string already cut the text; otherwise emit what was held back.
        if req.detok is not None and not isinstance(req.stop_reason, str):
            start = len(req.text)
            req.text += req.detok.flush()
            if req.params.stop and len(req.text) > start:
                hit = stop_checker_of(req).check(req.text, start)
                if hit is not None:
                    req.text, req.stop_reason = req.text[: hit[0]], hit[1]
                    reason = FinishReason.STOP
        req.finish_reason = reason
        req.grammar = None  # the matcher lives exactly as long as the request
        if self.tracer is not None and req.reported_cache:
            self._trace(req)
        if req.status != ReqStatus.FINISHED:
            self.scheduler.remove(req)
        req.status = ReqStatus.FINISHED
        self.requests.pop(req.request_id, None)
        self.counters["requests_finished_total"] += 1

    def _trace(self, req: Req) -> None:
        """Queue ``req`` for the cache trace while its KV length is still known."""
        assert self.tracer is not None
        prompt_len = len(req.prompt_ids)
        kv_ids = req.all_ids[: max(req.kv_len, prompt_len)]
        hit = {"device": req.cached_device, "host": req.cached_host, "storage": req.cached_storage}
        self.tracer.record(
            kv_ids,
            prompt_len,
            len(req.output_ids),
            req.arrival_time,
            req.cache_salt,
            hit,
            req.admit_time,
        )

    # ------------------------------------------------------------------ offline
    def generate(
        self,
        prompts: Sequence[PromptType],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run ``prompts`` to completion together; outputs in prompt order."""
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams() for _ in prompts]
        else:
            params_list = list(params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {len(prompts)} prompts"
                )
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.loop.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    # ------------------------------------------------------------------ admin
    def flush_cache(self) -> bool:
        """Drop every cached prefix; refused (False) while requests are running."""
        if self.scheduler.running:
            return False
        return self.kv.flush()

    def stats(self) -> dict[str, float]:
        """KV use per tier, queue lengths and the totals since start (see EngineStats),
        with the steps replayed from device graphs."""
        stats = self.reporter.snapshot()
        decode, mixed = self.runner.graphs, self.runner.mixed_graphs
        stats["decode_graph_replays_total"] = sum(decode.replays.values()) if decode else 0
        stats["mixed_graph_replays_total"] = sum(mixed.replays.values()) if mixed else 0
        return stats

    def health(self) -> dict[str, object]:
        return {
            "model": self.served_model_name,
            "model_path": str(self.model_path),
            "device": str(self.device_spec),
            "dtype": str(self.dtype).replace("torch.", ""),
            # bf16 on a CPU: float32 activations (dtype) over "bf16-weights"
            "weights": self.weights.tag,
            "kv_cache_dtype": str(self.kv.device_pool.dtype).replace("torch.", ""),
            "attention_backend": self.attention_backend,
            "max_model_len": self.max_model_len,
            "kv_total_tokens": self.kv.manager.capacity,
            "page_size": self.config.page_size,
            "max_prefill_tokens": self.scheduler.max_prefill_tokens,
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "device_graphs": self.runner.graphs is not None,
            # steps that prefill replay graphs too (engine/mixed_graphs.py)
            "mixed_graphs": self.runner.mixed_graphs is not None,
            "mixed_batches": self.scheduler.mixed,
            "overlap_schedule": self.overlap,
            **self.kv.host_health(),
        }

    @property
    def failure(self) -> BaseException | None:
        """Why the engine can no longer run (a tensor-parallel rank died), else None."""
        return self.tp.failure if self.tp is not None else None

    def watch_fatal(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback(error)``, from any thread, if the engine stops being able to run."""
        if self.tp is not None:
            self.tp.watch(callback)

    def close(self) -> None:
        if self.tracer is not None:
            self.tracer.close()
        self.grammars.close()
        self.kv.close()
        if self.tp is not None:
            self.tp.stop()
