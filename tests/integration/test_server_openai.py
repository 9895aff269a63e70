"""The official ``openai`` client against a real server on the default model.

References are independent of the HTTP path: the synchronous ``Engine.generate`` on the
same weights (greedy outputs), the HF tokenizer (token counts), and the unstopped or
unstreamed output of the same request (stop strings, streaming).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import httpx
import openai
import pytest

from engine.request import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
CHAT = [
    {"role": "system", "content": "You are concise."},
    {"role": "user", "content": "Name three colors."},
]


def parallel(*calls: Callable[[], Any]) -> list[Any]:
    """Run client calls at once (the server batches them): fewer sequential decode rounds."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def _greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def _chat_ids(ref_engine: Any, messages: list[dict[str, str]]) -> list[int]:
    text = ref_engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    return list(ref_engine.tokenizer.encode(text, add_special_tokens=False))


def test_models_and_health(client: openai.OpenAI, http: httpx.Client, model_name: str) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [model_name]
    assert client.models.retrieve(model_name).id == model_name
    health = http.get("/health").json()
    assert health["status"] == "ok"
    assert (health["device"], health["dtype"], health["kv_total_tokens"]) == (
        "cpu",
        "float32",
        4096,
    )
    assert "host_alloc_method" in health and health["pinned"] is False
    # the packed default model dequantized to float32, and the CPU's prefill step
    assert (health["weights"], health["max_prefill_tokens"]) == ("dense", 1024)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    # --model as given on the command line is an alias of the served name
    assert client.models.retrieve("default").id == model_name
    assert client.completions.create(model="default", prompt="x", max_tokens=1).choices


def test_greedy_completions_equal_engine(
    client: openai.OpenAI, ref_engine: Any, model_name: str
) -> None:
    expected = ref_engine.generate(PROMPTS, _greedy(10))
    results = parallel(
        *(
            partial(
                client.completions.create,
                model=model_name,
                prompt=prompt,
                max_tokens=10,
                temperature=0,
            )
            for prompt in PROMPTS
        )
    )
    for prompt, ref, result in zip(PROMPTS, expected, results, strict=True):
        choice = result.choices[0]
        assert choice.text == ref.text
        assert choice.finish_reason == ref.finish_reason
        assert result.usage is not None
        assert result.usage.prompt_tokens == len(ref_engine.tokenizer.encode(prompt))
        assert result.usage.completion_tokens == len(ref.token_ids)
        assert result.usage.total_tokens == result.usage.prompt_tokens + len(ref.token_ids)
        details = result.usage.prompt_tokens_details
        assert details is not None and details.cached_tokens is not None
        extra = details.model_extra or {}
        assert extra["cached_tokens_device"] + extra["cached_tokens_host"] == (
            details.cached_tokens
        )


def test_greedy_chat_equals_engine(client: openai.OpenAI, ref_engine: Any, model_name: str) -> None:
    ids = _chat_ids(ref_engine, CHAT)
    ref = ref_engine.generate([ids], _greedy(10))[0]
    create = partial(client.chat.completions.create, model=model_name, messages=CHAT, temperature=0)
    # max_completion_tokens is the newer name of the same limit
    result, again = parallel(
        partial(create, max_tokens=10), partial(create, max_completion_tokens=10)
    )
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == ref.text
    assert result.choices[0].finish_reason == ref.finish_reason
    assert result.usage is not None and result.usage.prompt_tokens == len(ids)
    assert again.choices[0].message.content == ref.text


def test_token_id_prompts(client: openai.OpenAI, ref_engine: Any, model_name: str) -> None:
    ids = [list(ref_engine.tokenizer.encode(p)) for p in PROMPTS[:2]]
    expected = ref_engine.generate(ids, _greedy(8))
    create = partial(client.completions.create, model=model_name, max_tokens=8, temperature=0)
    single, batch, strings = parallel(
        partial(create, prompt=ids[0]),
        partial(create, prompt=ids),
        partial(create, prompt=PROMPTS[:2]),
    )
    assert single.choices[0].text == expected[0].text
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [r.text for r in expected]
    assert [c.text for c in strings.choices] == [r.text for r in expected]


def test_streaming_equals_plain(client: openai.OpenAI, model_name: str) -> None:
    create = partial(
        client.completions.create,
        model=model_name,
        prompt="Write the Japanese word for thank you:",
        max_tokens=12,
        temperature=0,
    )
    plain, chunks = parallel(
        create, lambda: list(create(stream=True, stream_options={"include_usage": True}))
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == plain.choices[0].text
    # UTF-8 safe: no chunk carries a replacement character the full text does not have
    if "\ufffd" not in plain.choices[0].text:
        assert all("\ufffd" not in t for t in texts)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == plain.choices[0].finish_reason
    assert all(f is None for f in finals[:-1])
    assert not chunks[-1].choices and chunks[-1].usage is not None
    assert plain.usage is not None
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_chat_streaming_equals_plain(client: openai.OpenAI, model_name: str) -> None:
    create = partial(
        client.chat.completions.create,
        model=model_name,
        messages=CHAT,
        max_tokens=10,
        temperature=0,
    )
    plain, chunks = parallel(
        create, lambda: list(create(stream=True, stream_options={"include_usage": True}))
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == plain.choices[0].message.content
    assert chunks[-1].usage is not None and plain.usage is not None
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens


def _stream_text(create: Callable[..., Any], **kw: Any) -> str:
    return "".join(c.choices[0].text for c in create(stream=True, **kw) if c.choices)


def _join_stream(stream: Any) -> dict[int, str]:
    joined: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            joined[choice.index] = joined.get(choice.index, "") + choice.text
    return joined


def test_n2_and_seed(client: openai.OpenAI, model_name: str) -> None:
    create = partial(
        client.completions.create,
        model=model_name,
        prompt="My favourite animal is",
        max_tokens=8,
        n=2,
        temperature=1.0,
        seed=1234,
    )
    first, second, greedy, chat, streamed = parallel(
        create,
        create,
        partial(create, temperature=0),
        partial(
            client.chat.completions.create,
            model=model_name,
            messages=CHAT,
            n=2,
            max_tokens=6,
            seed=5,
        ),
        lambda: _join_stream(create(stream=True)),
    )
    assert [c.index for c in first.choices] == [0, 1]
    # seeded sampling is reproducible through HTTP, batched or not, streamed or not
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert [streamed[0], streamed[1]] == [c.text for c in first.choices]
    assert first.usage is not None and first.usage.completion_tokens <= 16
    assert greedy.choices[0].text == greedy.choices[1].text
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_stop_string(client: openai.OpenAI, model_name: str) -> None:
    create = partial(
        client.completions.create,
        model=model_name,
        prompt="List the numbers from one to ten: one, two,",
        max_tokens=12,
        temperature=0,
    )
    full = create().choices[0].text
    words = [w for w in full.split() if len(w) >= 2]
    assert len(words) >= 3, full
    stop = words[2]
    cut = full[: full.index(stop)]
    stopped, streamed = parallel(
        partial(create, stop=[stop, "never-matching-stop"]),
        partial(_stream_text, create, stop=stop),
    )
    assert stopped.choices[0].text == cut
    assert stopped.choices[0].finish_reason == "stop"
    assert streamed == cut


def test_logprobs(client: openai.OpenAI, model_name: str) -> None:
    result, chat = parallel(
        partial(
            client.completions.create,
            model=model_name,
            prompt="The sky is",
            max_tokens=6,
            temperature=0,
            logprobs=3,
        ),
        partial(
            client.chat.completions.create,
            model=model_name,
            messages=CHAT,
            max_tokens=4,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
        ),
    )
    choice = result.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert result.usage is not None and len(lp.tokens) == result.usage.completion_tokens
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob is not None and logprob <= 0
        assert 3 <= len(top) <= 4 and token in top
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4)  # greedy: the best one
    content = chat.choices[0].logprobs.content
    assert content is not None and len(content) == 4
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert bytes(entry.bytes or []).decode("utf-8") == entry.token


def test_echo(client: openai.OpenAI, model_name: str, ref_engine: Any) -> None:
    prompt = "Roses are red,"
    create = partial(
        client.completions.create, model=model_name, prompt=prompt, max_tokens=6, temperature=0
    )
    plain, echoed, streamed = parallel(
        create, partial(create, echo=True, logprobs=1), partial(_stream_text, create, echo=True)
    )
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    assert streamed == prompt + plain.choices[0].text
    n_prompt = len(ref_engine.tokenizer.encode(prompt))
    lp = echoed.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None
    # The prompt is scored (test_server_scoring.py checks the values): all but token 0.
    assert lp.token_logprobs[0] is None
    assert all(v is not None for v in lp.token_logprobs[1:])
    assert len(lp.token_logprobs) == n_prompt + 6


def test_repeated_prompt_is_cached(client: openai.OpenAI, model_name: str) -> None:
    prompt = "Cache me if you can. " * 20 + "The end of the story is"
    kw: dict[str, Any] = dict(model=model_name, prompt=prompt, max_tokens=2, temperature=0)
    first = client.completions.create(**kw)
    second = client.completions.create(**kw)
    assert first.usage is not None and second.usage is not None
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    # Exactly the whole prompt but its last token (computed again for its logits).
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    assert details.cached_tokens == second.usage.prompt_tokens - 1
    extra = details.model_extra or {}
    assert extra["cached_tokens_device"] == details.cached_tokens  # HiCache is off
    assert extra["cached_tokens_host"] == 0
    # Why the rest missed: the first time never seen, the second only the last token.
    assert first.usage.prompt_tokens_details is not None
    first_reasons = (first.usage.prompt_tokens_details.model_extra or {})["cache_miss_reasons"]
    assert (
        first.usage.prompt_tokens_details.cached_tokens + sum(first_reasons.values())
        == first.usage.prompt_tokens
    )
    assert first_reasons["below_page"] == 1 and first_reasons["evicted"] == 0
    assert extra["cache_miss_reasons"] == {
        "never_seen": 0, "evicted": 0, "below_page": 1, "not_loaded": 0,
        "storage_timeout": 0, "not_routed": 0,
    }  # fmt: skip
    chat = partial(
        client.chat.completions.create,
        model=model_name,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=2,
    )
    chat_first: Any = chat()
    chat_second: Any = chat()
    assert chat_first.usage.prompt_tokens_details.cached_tokens is not None
    assert chat_second.usage.prompt_tokens_details.cached_tokens == (
        chat_second.usage.prompt_tokens - 1
    )


def test_metrics_exposition(
    http: httpx.Client, client: openai.OpenAI, model_name: str, tools: Any
) -> None:
    before = http.get("/metrics").text
    client.completions.create(model=model_name, prompt="Hello there", max_tokens=3, temperature=0)
    after = http.get("/metrics").text
    value = tools.metric_value
    assert value(after, "hiserve:kv_total_tokens", 'tier="device"') == 4096
    for name in ("hiserve:kv_used_tokens", "hiserve:kv_cached_tokens"):
        for tier in ("device", "host"):
            value(after, name, f'tier="{tier}"')
    for name in ("hiserve:num_running_requests", "hiserve:num_waiting_requests"):
        value(after, name)
    for source in ("device", "host"):
        value(after, "hiserve:cached_prompt_tokens_total", f'source="{source}"')
    assert (
        value(after, "hiserve:generation_tokens_total")
        - value(before, "hiserve:generation_tokens_total")
        == 3
    )
    assert value(after, "hiserve:prompt_tokens_total") > value(
        before, "hiserve:prompt_tokens_total"
    )

    def delta(name: str, label: str) -> float:
        return value(after, name, label) - value(before, name, label)

    # Every prompt token is either cached (some tier) or missed for one reason.
    sources = ("device", "host", "storage")
    reasons = ("never_seen", "evicted", "below_page", "not_loaded", "storage_timeout")
    assert sum(delta("hiserve:cached_prompt_tokens_total", f'source="{s}"') for s in sources) + sum(
        delta("hiserve:prompt_tokens_missed_total", f'reason="{r}"') for r in reasons
    ) == (
        value(after, "hiserve:prompt_tokens_total") - value(before, "hiserve:prompt_tokens_total")
    )
    for hist in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
    ):
        name = f"hiserve:{hist}_count"
        assert value(after, name) > value(before, name)
