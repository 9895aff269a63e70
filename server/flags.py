"""The server's flag table: one row (server/flag_spec.py's FlagSpec) per command-line
flag, with the EngineConfig field it sets; each is read the same way from its
``HISERVE_`` environment variable."""

from __future__ import annotations

from engine.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    HICACHE_HOST_ALLOC,
    HICACHE_MEM_LAYOUTS,
    HICACHE_PREFETCH_POLICIES,
    HICACHE_STORAGE_BACKENDS,
    HICACHE_WRITE_POLICIES,
    KV_CACHE_DTYPES,
    SCHEDULE_POLICIES,
)
from server.cache_report import CACHED_TOKENS_SCOPES
from server.flag_spec import FlagSpec
from server.tools.parsers import PARSER_NAMES

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

# NOTE: one row per flag; test_server_args asserts that every EngineConfig field has a row.
FLAG_TABLE: tuple[FlagSpec, ...] = (
    FlagSpec("model", "model directory, .gguf file, or 'default' (the embedded model)", "model"),
    FlagSpec("served-model-name", "model name reported by the API", "served_model_name"),
    FlagSpec("device", "cpu, cuda, cuda:1, musa:0, npu, xpu, mps or auto", "device"),
    FlagSpec("dtype", "weight and activation precision", "dtype", choices=DTYPES),
    FlagSpec(
        "attention-backend",
        "attention kernels (auto: native CPU decode for float32 on CPU, else torch)",
        "attention_backend",
        choices=ATTENTION_BACKENDS,
    ),
    FlagSpec("cache-dir", "where converted GGUF models are cached", "cache_dir"),
    FlagSpec(
        "tensor-parallel-size",
        "devices (one process each) the model is split over; heads and MLPs are sharded",
        "tensor_parallel_size",
        aliases=("tp",),
    ),
    FlagSpec(
        "tensor-parallel-devices",
        "device indices of the ranks, e.g. 2,3 (default: consecutive from --device's index)",
        "tensor_parallel_devices",
    ),
    FlagSpec("seed", "seed of the engine's default random generator", "seed"),
    FlagSpec("kv-cache-tokens", "device KV pool size in tokens", "kv_cache_tokens"),
    FlagSpec("kv-mem-fraction", "fraction of free device memory for KV", "kv_mem_fraction"),
    FlagSpec(
        "kv-cache-dtype",
        "KV cache precision (auto: the model's; bfloat16 on the CPU halves the pool's bytes)",
        "kv_cache_dtype",
        choices=KV_CACHE_DTYPES,
    ),
    FlagSpec("page-size", "tokens per KV page", "page_size"),
    FlagSpec(
        "cache-trace",
        "write a cache trace (JSONL: page-hash chains and hits per request, no text or "
        "token ids) to this file, for hiserve-bench whatif",
        "cache_trace",
    ),
    FlagSpec(
        "disable-radix-cache", "turn the prefix cache off", "enable_prefix_cache", invert=True
    ),
    FlagSpec(
        "enable-hierarchical-cache", "enable the HiCache host tier", "enable_hierarchical_cache"
    ),
    FlagSpec("hicache-ratio", "host tier size as a multiple of the device pool", "hicache_ratio"),
    FlagSpec("hicache-size", "host tier size in GB (overrides --hicache-ratio)", "hicache_size"),
    FlagSpec(
        "hicache-mem-layout",
        "host buffer layout",
        "hicache_mem_layout",
        choices=HICACHE_MEM_LAYOUTS,
    ),
    FlagSpec(
        "hicache-write-policy",
        "when KV is backed up to the host tier",
        "hicache_write_policy",
        choices=HICACHE_WRITE_POLICIES,
    ),
    FlagSpec(
        "hicache-host-alloc",
        "how host tier memory is allocated",
        "hicache_host_alloc",
        choices=HICACHE_HOST_ALLOC,
    ),
    FlagSpec(
        "hicache-load-threshold",
        "host hits shorter than this are recomputed",
        "hicache_load_threshold",
    ),
    FlagSpec(
        "hicache-storage-backend",
        "L3 store below the host tier, shared by replicas and kept across restarts",
        "hicache_storage_backend",
        choices=HICACHE_STORAGE_BACKENDS,
    ),
    FlagSpec("hicache-storage-dir", "directory of the file L3 backend", "hicache_storage_dir"),
    FlagSpec(
        "hicache-storage-size",
        "GB the file L3 backend's directory may hold, counting every replica's pages "
        "(oldest pages go first; default 16)",
        "hicache_storage_size",
    ),
    FlagSpec(
        "hicache-storage-secret-file",
        "file holding the fleet secret that authenticates L3 pages (or set "
        "HISERVE_HICACHE_STORAGE_SECRET); see docs/cache-security.md",
        "hicache_storage_secret_file",
    ),
    FlagSpec(
        "hicache-storage-encrypt",
        "encrypt the file L3 backend's pages at rest (AES-GCM; extra l3-crypt)",
        "hicache_storage_encrypt",
    ),
    FlagSpec(
        "hicache-storage-prefetch-policy",
        "how long admission waits for L3 reads",
        "hicache_storage_prefetch_policy",
        choices=HICACHE_PREFETCH_POLICIES,
    ),
    FlagSpec(
        "hicache-storage-prefetch-threshold",
        "prompts continuing their cached prefix by fewer tokens skip L3",
        "hicache_storage_prefetch_threshold",
    ),
    FlagSpec("hicache-mooncake-master", "host:port of mooncake_master", "hicache_mooncake_master"),
    FlagSpec(
        "hicache-mooncake-metadata-server",
        "Mooncake metadata server (P2PHANDSHAKE or http://host:port/metadata)",
        "hicache_mooncake_metadata_server",
    ),
    FlagSpec("max-running-requests", "most requests decoded together", "max_running_requests"),
    FlagSpec("max-waiting-requests", "queue length before 503", "max_waiting_requests"),
    FlagSpec(
        "max-prefill-tokens",
        "most new prompt tokens per step (unset: 1024 on a CPU, where a burst of prompts "
        "then gets first tokens in turns; 4096 on a GPU)",
        "max_prefill_tokens",
    ),
    FlagSpec("chunked-prefill-size", "prompt chunk size", "chunked_prefill_size"),
    FlagSpec("schedule-policy", "order of admission", "schedule_policy", choices=SCHEDULE_POLICIES),
    FlagSpec(
        "disable-mixed-batches",
        "alternate prefill and decode steps instead of running decode tokens and prefill "
        "chunks in one forward (SGLang's --enable-mixed-chunk); unset: mixed unless decode "
        "replays device graphs; --no-disable-mixed-batches: mixed always",
        "enable_mixed_batches",
        invert=True,
    ),
    FlagSpec(
        "prefill-step-budget-ms",
        "size each step's prefill to take about this many milliseconds at the measured "
        "prefill speed (at least 64 tokens), so a long prompt does not hold every other "
        "request for its whole length, at some throughput (try 50 on a CPU); none "
        "(default): only --max-prefill-tokens",
        "prefill_step_budget_ms",
    ),
    FlagSpec(
        "disable-cuda-graph",
        "run decode steps eagerly instead of replaying device graphs (graphs are on by "
        "default on cuda and musa; the CPU has none)",
        "disable_cuda_graph",
    ),
    FlagSpec(
        "disable-overlap-schedule",
        "run each step to its sampled tokens before scheduling the next, instead of "
        "scheduling step N+1 while step N runs on the device (unset: not overlapped "
        "until a GPU device check has run it; --no-disable-overlap-schedule: overlapped "
        "everywhere but under tensor parallelism)",
        "disable_overlap_schedule",
    ),
    FlagSpec(
        "engine-process",
        "run the engine loop in a child process of its own, as SGLang's scheduler and "
        "vLLM's engine core run, so the HTTP side's Python never waits for the engine's "
        "(default: in a thread of the server's process)",
        "engine_process",
    ),
    FlagSpec(
        "cuda-graph-max-bs",
        "largest decode batch replayed from a device graph (default: --max-running-requests)",
        "cuda_graph_max_bs",
    ),
    FlagSpec("max-model-len", "context length (prompt + output)", "max_model_len"),
    FlagSpec("max-stop-strings", "most stop strings per request", "max_stop_strings"),
    FlagSpec("max-stop-chars", "longest stop string, in characters", "max_stop_chars"),
    FlagSpec("max-stop-token-ids", "most stop_token_ids per request", "max_stop_token_ids"),
    FlagSpec(
        "max-logit-bias",
        "most logit_bias entries per request (OpenAI's limit); 0 refuses logit_bias",
        "max_logit_bias",
    ),
    FlagSpec(
        "max-logprobs",
        "most logprobs / top_logprobs a request may ask for (vLLM's max_logprobs)",
        "max_logprobs",
    ),
    FlagSpec(
        "max-logprob-entries",
        "most logprob entries one request may return: choices x max_tokens x (1 + top_logprobs)",
        "max_logprob_entries",
    ),
    FlagSpec(
        "max-queued-outputs",
        "outputs queued per stream for a slow reader before they are merged and its request "
        "pauses (until half are read)",
        "max_queued_outputs",
    ),
    FlagSpec(
        "stream-interval",
        "a streamed request gets a chunk every this many tokens (the first at once, the "
        "last at the end); larger: less host work per token, a coarser stream",
        "stream_interval",
    ),
    FlagSpec(
        "stream-stall-timeout",
        "seconds a stream's reader may take nothing before its request is ended",
        "stream_stall_timeout",
    ),
    FlagSpec(
        "grammar-compile-timeout",
        "seconds a structured-output request may wait for its grammar to compile",
        "grammar_compile_timeout",
    ),
    FlagSpec(
        "grammar-step-budget-ms",
        "milliseconds of grammar work (mask fill + accept) a constrained request may take "
        "per token; past it the request ends with an error",
        "grammar_step_budget_ms",
    ),
    FlagSpec(
        "grammar-cache-mb",
        "MB of compiled grammars kept for reuse (least recently used go first)",
        "grammar_cache_mb",
    ),
    FlagSpec(
        "max-grammar-choices",
        "most choices (prompts x n) of a request with an output constraint",
        "max_grammar_choices",
    ),
    # server-only
    FlagSpec("host", "address to listen on", kind="str", default="127.0.0.1"),
    FlagSpec("port", "port to listen on", kind="int", default=8000),
    FlagSpec(
        "fd",
        "serve on this inherited, already bound socket instead of --host/--port "
        "(a supervisor or test that holds the port hands it over with no window to lose it)",
        kind="int",
        optional=True,
    ),
    FlagSpec(
        "api-key",
        "the client key: require 'Authorization: Bearer <key>' on /v1 and /metrics (and on "
        "the admin routes when --admin-key is unset); prefer the environment variable, which "
        "`ps` does not show",
        kind="str",
        optional=True,
    ),
    FlagSpec(
        "admin-key",
        "the fleet's router/replica key: the only key that opens /flush_cache, /server_info, "
        "/model_info and /v1/loads, and it opens every other route too; give the router "
        "this key, and clients --api-key",
        kind="str",
        optional=True,
    ),
    FlagSpec(
        "metrics-public",
        "serve /metrics without a key (for a scraper that cannot send one)",
        kind="bool",
        default=False,
    ),
    FlagSpec(
        "cached-tokens-scope",
        "what usage.cached_tokens reports: all (every hit), key (only prefixes the same "
        "bearer token sent before; others' cached prompts cannot be probed) or none (always "
        "0); see docs/cache-security.md",
        kind="str",
        default="all",
        choices=CACHED_TOKENS_SCOPES,
    ),
    FlagSpec(
        "require-cache-salt",
        "refuse (400) requests without a cache_salt: every tenant's cached KV stays its own "
        "(multi-tenant deployments; see docs/cache-security.md)",
        kind="bool",
        default=False,
    ),
    FlagSpec(
        "cache-salt-from-key",
        "partition the cache by the caller's bearer token as well as its cache_salt, so "
        "two keys never share cached KV (behind a gateway with per-tenant keys that "
        "forwards them, e.g. smg --tenant-api-key; see docs/cache-security.md)",
        kind="bool",
        default=False,
    ),
    FlagSpec("log-level", "logging level", kind="str", default="info", choices=LOG_LEVELS),
    FlagSpec(
        "max-body-bytes",
        "largest request body accepted (413 past it)",
        kind="int",
        default=8 * 1024 * 1024,
    ),
    FlagSpec(
        "max-connections",
        "open connections in all; past it a new one gets a 503 and is closed (keep it "
        "below the descriptor limit, ulimit -n)",
        kind="int",
        default=4096,
    ),
    FlagSpec(
        "max-connections-per-client",
        "open connections from one client address (0: no cap); raise it on a replica "
        "behind a router, whose connections all come from one address",
        kind="int",
        default=256,
    ),
    FlagSpec(
        "header-timeout",
        "seconds a connection may take to send complete request headers (slowloris guard)",
        kind="float",
        default=10.0,
    ),
    FlagSpec(
        "body-timeout",
        "seconds a request may take to send its whole body (408 past it)",
        kind="float",
        default=60.0,
    ),
    FlagSpec(
        "send-timeout",
        "seconds a response write may wait on a client that reads nothing before the "
        "connection is aborted (its request ends and frees its running slot)",
        kind="float",
        default=15.0,
    ),
    FlagSpec(
        "send-buffer-bytes",
        "socket send buffer and write high-water mark per connection: how much a client "
        "that reads nothing can absorb before --send-timeout starts (0: the system's)",
        kind="int",
        default=64 * 1024,
    ),
    FlagSpec(
        "shutdown-grace",
        "seconds in-flight requests get to finish on SIGTERM",
        kind="float",
        default=30.0,
    ),
    FlagSpec(
        "max-choices",
        "most choices (prompts x n) per request",
        kind="int",
        default=256,
    ),
    FlagSpec(
        "max-choice-prompt-tokens",
        "most prompt tokens summed over a request's choices (prompt length x n, over "
        "every prompt) when it has more than one; each copy's prefill reads its prompt",
        kind="int",
        default=131072,
    ),
    FlagSpec(
        "allowed-hosts",
        "comma-separated Host header values accepted (DNS-rebinding guard; '*': any); "
        "unset: any when a key is set, else localhost, 127.0.0.1 and [::1] only",
        kind="str",
        optional=True,
    ),
    FlagSpec(
        "enable-docs",
        "serve /docs, /redoc and /openapi.json",
        kind="bool",
        default=False,
    ),
    FlagSpec(
        "trust-message-special-tokens",
        "tokenize special-token strings inside chat message content as control tokens "
        "(only for trusted callers: lets them forge system and assistant turns)",
        kind="bool",
        default=False,
    ),
    FlagSpec(
        "tool-call-parser",
        "format of tool calls in free text (auto: from the chat template; hermes otherwise)",
        kind="str",
        default="auto",
        choices=PARSER_NAMES,
    ),
)
