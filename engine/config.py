"""Frozen engine configuration.

The chain ModelConfig -> CacheConfig -> SchedulerConfig -> EngineConfig keeps every
field in one flat keyword namespace (``EngineConfig(model=..., page_size=...)``) while
each layer of the engine only needs to know the part it reads.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

SCHEDULE_POLICIES = ("fcfs", "lpm")
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
HICACHE_MEM_LAYOUTS = ("layer_first", "page_first")
HICACHE_HOST_ALLOC = ("auto", "pin_memory", "host_register", "pageable")
HICACHE_STORAGE_BACKENDS = ("none", "file", "mooncake")
HICACHE_PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")
# Tokens per KV page when an L3 storage backend is set and no page size was given: the
# store keeps one object per page, so one token per page (the default) cannot work.
L3_DEFAULT_PAGE_SIZE = 16
# auto: the native CPU decode kernel for float32 on the CPU where it builds, else torch.
ATTENTION_BACKENDS = ("auto", "torch", "cpu_native", "triton")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load, where, and in what precision."""

    model: str = "default"
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"
    served_model_name: str | None = None
    # Where converted GGUF models are cached; None: $HISERVE_CACHE_DIR or ~/.cache/hiserve.
    cache_dir: str | None = None
    seed: int = 0
    # Ranks (devices, one process each) the model's heads and MLPs are split over.
    tensor_parallel_size: int = 1
    # Device indices of the ranks, e.g. "2,3"; None: consecutive from --device's index.
    tensor_parallel_devices: str | None = None


@dataclass(frozen=True)
class CacheConfig(ModelConfig):
    """Device KV pool, prefix cache and HiCache host tier."""

    # Device KV pool size in tokens; None: derive from kv_mem_fraction of free memory.
    kv_cache_tokens: int | None = None
    kv_mem_fraction: float = 0.5
    # The pool's element type: auto is the model's (its activations'); bfloat16 on the CPU
    # halves the pool's bytes (vLLM's --kv-cache-dtype; engine/dtypes.py).
    kv_cache_dtype: str = "auto"
    page_size: int = 1
    enable_prefix_cache: bool = True
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: float | None = None  # GB; overrides hicache_ratio when set
    hicache_mem_layout: str = "layer_first"
    hicache_write_policy: str = "write_through"
    hicache_host_alloc: str = "auto"
    # Host hits shorter than this are recomputed instead of loaded back.
    hicache_load_threshold: int = 16
    # L3: a page store below the host tier, shared by replicas and kept across restarts.
    hicache_storage_backend: str = "none"
    hicache_storage_dir: str | None = None  # the file backend's directory
    # GB the file backend's directory may hold, every replica's pages counted.
    hicache_storage_size: float = 16.0
    # The fleet secret L3 pages are authenticated with is read from this file (or from
    # $HISERVE_HICACHE_STORAGE_SECRET); see docs/cache-security.md.
    hicache_storage_secret_file: str | None = None
    hicache_storage_encrypt: bool = False  # AES-GCM the file backend's pages at rest
    hicache_storage_prefetch_policy: str = "timeout"
    # Prompts continuing past their device/host match by fewer tokens skip the store.
    hicache_storage_prefetch_threshold: int = 256
    hicache_mooncake_master: str | None = None  # host:port of mooncake_master
    hicache_mooncake_metadata_server: str = "P2PHANDSHAKE"
    # JSONL file of cache-relevant events per finished request (engine/cache_trace.py);
    # None: no trace, and nothing is hashed.
    cache_trace: str | None = None


# A step's prompt tokens where --max-prefill-tokens is not given. On a CPU a burst of
# prompts then gets its first tokens in turns, a step of about 0.2 s each (the default
# model in bf16 on 2 cores), instead of all of them after one prefill of every prompt:
# 32 prompts of 128 tokens, served, mean first token 0.68-0.75 s against 0.99-1.12 s
# with 4,096, the same output tokens/s (docs/performance.md, 2026-12-07). vLLM's CPU
# server takes 2,048 a step. On a GPU a token is cheap and a larger step costs little.
CPU_MAX_PREFILL_TOKENS = 1024
DEVICE_MAX_PREFILL_TOKENS = 4096


def default_max_prefill_tokens(device_type: str) -> int:
    """The prompt tokens a step carries on ``device_type`` unless configured."""
    return CPU_MAX_PREFILL_TOKENS if device_type == "cpu" else DEVICE_MAX_PREFILL_TOKENS


@dataclass(frozen=True)
class SchedulerConfig(CacheConfig):
    """Batching limits and policy."""

    max_running_requests: int = 64
    max_waiting_requests: int = 1024
    # Most prompt tokens one step carries; None: CPU_MAX_PREFILL_TOKENS on a CPU,
    # DEVICE_MAX_PREFILL_TOKENS elsewhere (engine/build.py settles it).
    max_prefill_tokens: int | None = None
    chunked_prefill_size: int = 1024
    schedule_policy: str = "fcfs"
    # One forward holds the running requests' decode tokens and new prefill chunks
    # together (SGLang's --enable-mixed-chunk); False: prefill and decode steps alternate.
    # None (auto): mixed unless decode steps replay device graphs, whose graphed decode
    # step beats an eager mixed one (measured on an H200; see docs/performance.md, "Mixed batches").
    enable_mixed_batches: bool | None = None
    # A step carries the prefill that fits in this many milliseconds at the prefill speed
    # measured so far (at least 64 tokens), so a long prompt never holds every other
    # request for its whole length (engine/step_budget.py). None (the default: on a CPU
    # it costs prefill-heavy batches 19-30% of their throughput, docs/limits.md): only
    # the token limits.
    prefill_step_budget_ms: float | None = None
    # Context length; None: the model config's max_position_embeddings.
    max_model_len: int | None = None
    max_stop_strings: int = 16
    # Longest stop string (characters): every step searches the new text for each one.
    max_stop_chars: int = 512
    # Most stop_token_ids per request (held as a set, validated once per request).
    max_stop_token_ids: int = 256
    # Most top logprobs per token a request may ask for (vLLM's max_logprobs).
    max_logprobs: int = 20
    # Most logit_bias entries per request (OpenAI's documented limit): each one is a
    # (row, token) update of every step's logits. 0: logit_bias is refused.
    max_logit_bias: int = 300
    # Most logprob entries one request may return: choices x max_tokens x (1 + top
    # logprobs); about 80 bytes of JSON each.
    max_logprob_entries: int = 1 << 20
    # Outputs a stream may have queued for a reader that is not reading; past that they
    # are merged into one pending delta and the request pauses until half are read, and
    # a reader that stays away for stream_stall_timeout seconds has its request ended
    # and its KV freed.
    max_queued_outputs: int = 64
    stream_stall_timeout: float = 30.0
    # A streamed request gets an output every this many tokens (SGLang's and vLLM's
    # --stream-interval): its first token at once, its last at the end, each output
    # carrying the deltas since the one before. Larger: less host work per token.
    stream_interval: int = 1


@dataclass(frozen=True)
class EngineConfig(SchedulerConfig):
    """Everything the engine needs; the server's arguments map onto it."""

    # Seconds a structured-output request waits for its grammar to compile before it fails.
    grammar_compile_timeout: float = 30.0
    # Grammar work (mask fill + accept) one request may take per generated token, in ms;
    # past it the request ends with an error (an ambiguous grammar's cost grows per step).
    grammar_step_budget_ms: float = 50.0
    # Compiled grammars kept for reuse, in MB of xgrammar's own accounting (LRU).
    grammar_cache_mb: float = 256.0
    # Most choices (prompts x n) of one constrained request: each copy has its own matcher.
    max_grammar_choices: int = 8
    # Device graphs (CUDA / MUSA) replay pure decode steps (engine/graph_runner.py); they
    # are never used on the CPU, which has none. SGLang's flag names.
    disable_cuda_graph: bool = False
    # Largest decode batch replayed from a graph; None: max_running_requests.
    cuda_graph_max_bs: int | None = None
    # The overlapped loop (engine/step_loop.py) launches step N+1 before step N's tokens
    # reach the host. None: off everywhere until a device check has run it on a GPU
    # (step_loop.OVERLAP_DEVICES; on the CPU it gains nothing: host and forward share the
    # cores); always off under tensor parallelism. SGLang's flag name.
    disable_overlap_schedule: bool | None = None
    # The server runs the engine loop in a child process of its own
    # (engine/engine_process.py), so the HTTP side's Python never waits for the engine's
    # on one interpreter lock. Read by the server's engine factory only.
    engine_process: bool = False

    def __post_init__(self) -> None:
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_choice("schedule_policy", self.schedule_policy, SCHEDULE_POLICIES)
        _check_choice("hicache_write_policy", self.hicache_write_policy, HICACHE_WRITE_POLICIES)
        _check_choice("hicache_mem_layout", self.hicache_mem_layout, HICACHE_MEM_LAYOUTS)
        _check_choice("hicache_host_alloc", self.hicache_host_alloc, HICACHE_HOST_ALLOC)
        _check_choice(
            "hicache_storage_backend", self.hicache_storage_backend, HICACHE_STORAGE_BACKENDS
        )
        _check_choice(
            "hicache_storage_prefetch_policy",
            self.hicache_storage_prefetch_policy,
            HICACHE_PREFETCH_POLICIES,
        )
        if self.hicache_storage_backend != "none":
            if not self.enable_hierarchical_cache:
                raise ValueError(
                    "an L3 storage backend sits below the HiCache host tier: add "
                    "--enable-hierarchical-cache (or drop --hicache-storage-backend)"
                )
            if not self.hicache_storage_size > 0:
                raise ValueError(
                    f"hicache_storage_size must be > 0 GB, got {self.hicache_storage_size}"
                )
            if self.page_size < 2:
                raise ValueError(
                    "the L3 store keeps one object per KV page, so --page-size 1 would "
                    "store every token on its own: use --page-size 16 to 64 with "
                    "--hicache-storage-backend"
                )
        if self.tensor_parallel_size > 1 and self.hicache_storage_backend != "none":
            raise ValueError(
                "the L3 storage tier does not support tensor parallelism yet (each rank's "
                "pages would need their own store keys): drop --hicache-storage-backend or "
                "use --tensor-parallel-size 1"
            )
        for name in (
            "tensor_parallel_size",
            "page_size",
            "max_running_requests",
            "max_prefill_tokens",
            "chunked_prefill_size",
            "max_waiting_requests",
            "max_stop_token_ids",
            "max_stop_chars",
            "max_logprob_entries",
            "max_queued_outputs",
            "stream_interval",
        ):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 2 * self.page_size:
            raise ValueError(
                f"kv_cache_tokens={self.kv_cache_tokens} is too small; "
                f"it must hold at least two pages of page_size={self.page_size}"
            )
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.max_logit_bias < 0:
            raise ValueError(f"max_logit_bias must be >= 0, got {self.max_logit_bias}")
        if self.stream_stall_timeout <= 0:
            raise ValueError(
                f"stream_stall_timeout must be > 0 seconds, got {self.stream_stall_timeout}"
            )
        if not 0.0 < self.kv_mem_fraction <= 1.0:
            raise ValueError(f"kv_mem_fraction must be in (0, 1], got {self.kv_mem_fraction}")
        if self.hicache_ratio <= 0:
            raise ValueError(f"hicache_ratio must be > 0, got {self.hicache_ratio}")
        if self.prefill_step_budget_ms is not None and self.prefill_step_budget_ms <= 0:
            raise ValueError(
                f"prefill_step_budget_ms must be > 0 (or None), got {self.prefill_step_budget_ms}"
            )
        if self.grammar_step_budget_ms <= 0:
            raise ValueError(
                f"grammar_step_budget_ms must be > 0, got {self.grammar_step_budget_ms}"
            )
        if self.grammar_cache_mb < 0:
            raise ValueError(f"grammar_cache_mb must be >= 0, got {self.grammar_cache_mb}")
        if self.max_grammar_choices < 1:
            raise ValueError(f"max_grammar_choices must be >= 1, got {self.max_grammar_choices}")
        if self.grammar_compile_timeout <= 0:
            raise ValueError(
                f"grammar_compile_timeout must be > 0 s, got {self.grammar_compile_timeout}"
            )
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(
                f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}; "
                "use --disable-cuda-graph to turn device graphs off"
            )
        if self.hicache_size is not None and self.hicache_size <= 0:
            raise ValueError(f"hicache_size must be > 0 GB, got {self.hicache_size}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.field_names()}


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {', '.join(choices)}")
