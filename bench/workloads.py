"""Seeded workload generators and the ideal hit rate of an unbounded prefix cache.

Prompts are lists of token ids drawn from a seeded RNG over a vocabulary range, so the
prompt-token accounting is exact and the ideal hit rate follows from the prompts alone.

NOTE: in ``multiturn`` the assistant turns that go into the conversation history are
synthetic token ids drawn from the seed, not the model's real output. Every prompt of a
run is therefore known before the run starts, and the ideal hit rate is exact. A server
that caches its own output tokens gains nothing from them here: the next round's prompt
shares only the previous round's *prompt* as a prefix.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from bench.words import text_for

WORKLOADS = ("multiturn", "shared-prefix", "random", "long-tail")
# tokens: prompts are token ids (exact accounting); text: the same draws as real words
# (bench/words.py), for servers and routers that take text only.
PROMPT_MODES = ("tokens", "text")


@dataclass(frozen=True)
class WorkloadConfig:
    """Every knob of every workload; each generator reads the ones it needs."""

    workload: str = "multiturn"
    seed: int = 0
    vocab_low: int = 1000  # token ids are drawn from [vocab_low, vocab_high)
    vocab_high: int = 40000
    output_len: int = 16  # max_tokens of every request (sent with ignore_eos)
    prompt_mode: str = "tokens"
    # Lengths are drawn uniformly from [ceil(L * range_ratio), L]; 1.0 keeps them fixed.
    range_ratio: float = 1.0
    # multiturn
    num_clients: int = 8
    num_rounds: int = 4
    system_prompt_len: int = 0  # shared by every client; 0: none
    user_turn_len: int = 256
    assistant_turn_len: int = 64  # synthetic history appended after each round
    # shared-prefix
    num_groups: int = 4
    prompts_per_group: int = 8
    shared_prefix_len: int = 1024
    suffix_len: int = 128
    # long-tail: num_prompts requests over num_groups documents (also uses suffix_len)
    zipf_s: float = 1.1  # document popularity ~ 1 / rank^s: a few hot, a long cold tail
    # random (and long-tail)
    num_prompts: int = 32
    input_len: int = 512

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}; choose one of {WORKLOADS}")
        if self.prompt_mode not in PROMPT_MODES:
            raise ValueError(
                f"unknown prompt mode {self.prompt_mode!r}; choose one of {PROMPT_MODES}"
            )
        if not 0 <= self.vocab_low < self.vocab_high:
            raise ValueError(
                f"vocab range [{self.vocab_low}, {self.vocab_high}) is empty or negative"
            )
        if not self.zipf_s > 0.0:
            raise ValueError(f"zipf_s must be > 0, got {self.zipf_s}")
        if not 0.0 < self.range_ratio <= 1.0:
            raise ValueError(f"range_ratio must be in (0, 1], got {self.range_ratio}")
        positive = (
            "output_len",
            "num_clients",
            "num_rounds",
            "user_turn_len",
            "num_groups",
            "prompts_per_group",
            "suffix_len",
            "num_prompts",
            "input_len",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("system_prompt_len", "assistant_turn_len", "shared_prefix_len"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: its prompt, and where it sits in its conversation."""

    index: int  # position in the workload's nominal send order
    prompt: list[int]  # token ids; in text mode, the ids of its words (one per word)
    max_tokens: int
    conversation: int  # requests of one conversation are sent one after another
    round: int  # 0-based position inside the conversation
    text: str | None = None  # text mode: what is sent instead of ``prompt``


@dataclass
class Workload:
    """The requests of one run, in nominal send order, and the config that made them."""

    config: WorkloadConfig
    requests: list[BenchRequest] = field(default_factory=list)

    @property
    def num_rounds(self) -> int:
        return 1 + max((r.round for r in self.requests), default=0)

    def ideal_hit_rate(self) -> float:
        """Ideal hit rate when the requests are sent in nominal order."""
        return ideal_hit_rate([r.prompt for r in self.requests])


def generate(config: WorkloadConfig) -> Workload:
    """Build the workload named by ``config.workload``; same config, same requests."""
    rng = np.random.default_rng(config.seed)
    if config.workload == "multiturn":
        requests = _multiturn(config, rng)
    elif config.workload == "shared-prefix":
        requests = _shared_prefix(config, rng)
    elif config.workload == "long-tail":
        requests = _long_tail(config, rng)
    else:
        requests = _random(config, rng)
    if config.prompt_mode == "text":
        requests = [replace(r, text=text_for(r.prompt)) for r in requests]
    return Workload(config=config, requests=requests)


def _draw_len(config: WorkloadConfig, rng: np.random.Generator, length: int) -> int:
    if length == 0 or config.range_ratio >= 1.0:
        return length
    low = max(1, math.ceil(length * config.range_ratio))
    return int(rng.integers(low, length + 1))


def _draw_tokens(config: WorkloadConfig, rng: np.random.Generator, length: int) -> list[int]:
    ids = rng.integers(config.vocab_low, config.vocab_high, size=length)
    return [int(t) for t in ids]


def _multiturn(config: WorkloadConfig, rng: np.random.Generator) -> list[BenchRequest]:
    system = _draw_tokens(config, rng, config.system_prompt_len)
    # Draw every client's turns first, client by client, so that one client's prompts do
    # not depend on how many clients there are after it.
    turns: list[list[tuple[list[int], list[int]]]] = []
    for _client in range(config.num_clients):
        conversation = []
        for _round in range(config.num_rounds):
            user = _draw_tokens(config, rng, _draw_len(config, rng, config.user_turn_len))
            assistant = _draw_tokens(config, rng, _draw_len(config, rng, config.assistant_turn_len))
            conversation.append((user, assistant))
        turns.append(conversation)
    # Nominal order is round-major (c0r0, c1r0, ..., c0r1, ...): between two rounds of one
    # conversation come the turns of every other client.
    requests: list[BenchRequest] = []
    for round_idx in range(config.num_rounds):
        for client in range(config.num_clients):
            prompt = list(system)
            for user, assistant in turns[client][:round_idx]:
                prompt += user + assistant
            prompt += turns[client][round_idx][0]
            requests.append(
                BenchRequest(len(requests), prompt, config.output_len, client, round_idx)
            )
    return requests


def _shared_prefix(config: WorkloadConfig, rng: np.random.Generator) -> list[BenchRequest]:
    prompts: list[list[int]] = []
    for _group in range(config.num_groups):
        system = _draw_tokens(config, rng, config.shared_prefix_len)
        for _ in range(config.prompts_per_group):
            suffix = _draw_tokens(config, rng, _draw_len(config, rng, config.suffix_len))
            prompts.append(system + suffix)
    # Interleave the groups (seeded) so each group's prefix has to survive the others.
    order = rng.permutation(len(prompts))
    return [BenchRequest(i, prompts[int(j)], config.output_len, i, 0) for i, j in enumerate(order)]


def _long_tail(config: WorkloadConfig, rng: np.random.Generator) -> list[BenchRequest]:
    """Documents of heavy-tailed length (lognormal around ``shared_prefix_len``, at most
    4x) asked about with Zipf popularity, each request a new question (``suffix_len``)."""
    lengths = rng.lognormal(math.log(max(config.shared_prefix_len, 1)), 0.75, config.num_groups)
    cap = 4 * config.shared_prefix_len
    documents = [_draw_tokens(config, rng, int(min(n, cap))) for n in lengths]
    weights = 1.0 / np.arange(1, config.num_groups + 1) ** config.zipf_s
    picks = rng.choice(config.num_groups, size=config.num_prompts, p=weights / weights.sum())
    requests = []
    for i, doc in enumerate(picks):
        suffix = _draw_tokens(config, rng, _draw_len(config, rng, config.suffix_len))
        requests.append(BenchRequest(i, documents[int(doc)] + suffix, config.output_len, i, 0))
    return requests


def _random(config: WorkloadConfig, rng: np.random.Generator) -> list[BenchRequest]:
    requests = []
    for i in range(config.num_prompts):
        prompt = _draw_tokens(config, rng, _draw_len(config, rng, config.input_len))
        requests.append(BenchRequest(i, prompt, config.output_len, i, 0))
    return requests


class _PrefixTrie:
    """A token trie over every prompt seen so far (page size 1, never evicts)."""

    def __init__(self) -> None:
        self._root: dict[int, dict] = {}

    def match_and_insert(self, tokens: Iterable[int]) -> int:
        """Length of the longest prefix of ``tokens`` already present; then insert it."""
        node = self._root
        matched = 0
        for token in tokens:
            child = node.get(token)
            if child is None:
                # Past the first miss every node is new, so no later token can match.
                child = node[token] = {}
            else:
                matched += 1
            node = child
        return matched


def ideal_cached_tokens(prompts: Sequence[Sequence[int]]) -> list[int]:
    """Per prompt, in send order: the longest prefix shared with any earlier prompt.

    That is what an unbounded prefix cache with page size 1 serves from cache when it
    keeps every earlier prompt (and nothing else). The first prompt always gets 0.
    NOTE: capped at ``len(prompt) - 1``: a server computes at least the last prompt token
    to get the logits of the first output token, so a repeated prompt is not a full hit.
    """
    trie = _PrefixTrie()
    return [min(trie.match_and_insert(p), max(len(p) - 1, 0)) for p in prompts]


def ideal_hit_rate(prompts: Sequence[Sequence[int]]) -> float:
    """Cached / prompt tokens of an unbounded cache over ``prompts`` in send order."""
    total = sum(len(p) for p in prompts)
    return sum(ideal_cached_tokens(prompts)) / total if total else 0.0
