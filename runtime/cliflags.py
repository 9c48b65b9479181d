"""llama-server's command line as one table: every llama-server option is accepted here.

Every option that ``llama-server --help`` lists (the llama.cpp that llama-cpp-python 0.3.36
vendors, ``common/arg.cpp``), every spelling of it and its ``LLAMA_ARG_*`` variable, is in
exactly one group below. A group says what ``llamactor serve`` does with its options:

- ``CONFIG``   sets a ``RuntimeConfig`` field;
- ``SAMPLING`` sets a server-wide sampling default (``RuntimeConfig.sampling``): requests that
  do not send the field get it, on the native and the OpenAI API and in ``Runtime.complete``;
- ``PROCESS``  belongs to the process, not the runtime (listen address, TLS, logs);
- ``IGNORE``   accepted, with one log line saying why it has no meaning here;
- ``REFUSE``   needs a download (llamactor never downloads) or was removed from llama-server
               itself: startup stops with exit code 2 naming it.

An IGNORE or REFUSE option may accept some values silently (``ok``): those that are already
what llamactor does (``--spec-type none``, ``--fit off``). A flag given
on the command line wins over its variable, as in llama-server. llamactor's own flags
(pipeline groups, schedulers) are a CONFIG group of their own at the end.

This module is the table, one declaration a group (so it is long on purpose); its value parsers
are ``runtime.flagvalues``; the machinery (``Opt``, ``Group``, argparse,
variables) is ``runtime.cliargs``, and ``runtime.serveoptions`` refuses and builds the config.
"""

from __future__ import annotations

from llamactor.runtime import flagvalues as values
from llamactor.runtime.cliargs import Group, Sets, Use, opt, switch
from llamactor.runtime.engine import placement
from llamactor.runtime.engine.overrides import ROPE_SCALING_TYPES
from llamactor.runtime.http.agent import flags as agent_tools

_off = values.is_one_of(False)
_LOGS = "llamactor logs with structlog to stderr: JSON when stderr is not a terminal (see --log-format)"
_DRAFT = (
    "draft tuning left at llama.cpp's defaults (threads, placement, KV types, backend sampling); "
    "synthetic acceptance and the tree split are not built"
)
_MTMD = "the projector (--mmproj) runs on the model's devices; video input is not built"

# ---- the table ---------------------------------------------------------------------------

GROUPS: tuple[Group, ...] = (
    Group(
        "Model and context",
        Use.CONFIG,
        "as in llama-server; -np/-t -1 = auto; -cb is logged (continuous batching "
        "is always on), -nocb selects the no-cont-batching scheduler",
        (
            opt("-m", "--model", field="model", value="FNAME", env="LLAMA_ARG_MODEL"),
            opt(
                "-a",
                "--alias",
                field="aliases",
                value="STRING",
                env="LLAMA_ARG_ALIAS",
                many=True,
                convert=values.names,
                help="the model's names, comma-separated: /v1/models lists them, the first in sorted order is its id",
            ),
            opt(
                "--tags",
                field="tags",
                value="STRING",
                env="LLAMA_ARG_TAGS",
                many=True,
                convert=values.names,
                help="comma-separated, listed by /v1/models (informational)",
            ),
            opt(
                "-c",
                "--ctx-size",
                field="n_ctx",
                env="LLAMA_ARG_CTX_SIZE",
                parse=values.ctx_size,
                help="total context C over all slots",
            ),
            opt(
                "-np", "--parallel", field="parallel", env="LLAMA_ARG_N_PARALLEL", parse=values.auto_int, help="slots P"
            ),
            opt("-b", "--batch-size", field="n_batch", env="LLAMA_ARG_BATCH", parse=int),
            opt("-ub", "--ubatch-size", field="n_ubatch", env="LLAMA_ARG_UBATCH", parse=int),
            opt(
                "-t",
                "--threads",
                field="threads",
                env="LLAMA_ARG_THREADS",
                parse=values.auto_int,
                help="-1 = all cores",
            ),
            opt("-tb", "--threads-batch", field="threads_batch", parse=values.auto_int),
            switch(
                "-kvu",
                "--kv-unified",
                neg=("-no-kvu", "--no-kv-unified"),
                field="kv_unified",
                env="LLAMA_ARG_KV_UNIFIED",
            ),
            opt(
                "-ctxcp",
                "--ctx-checkpoints",
                "--swa-checkpoints",
                field="ctx_checkpoints",
                value="N",
                env="LLAMA_ARG_CTX_CHECKPOINTS",
                parse=int,
                help="sliding-window models: window checkpoints kept a slot, taken as prompts go in "
                "(4 + --ubatch-size and 4 tokens before their end, and at chunk ends) (0: none)",
            ),
            opt(
                "-cms",
                "--checkpoint-min-step",
                field="checkpoint_min_step",
                value="N",
                env="LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT",
                parse=int,
                help="tokens between two checkpoints taken at prefill chunk ends",
            ),
            switch(
                "--swa-full",
                field="swa_full",
                env="LLAMA_ARG_SWA_FULL",
                help="sliding-window layers keep every position (more memory): a prefix stays reusable",
            ),
            opt(
                "--kv-unified-per-slot",
                field="kv_unified_per_slot",
                env="LLAMA_ARG_KV_UNIFIED_PER_SLOT",
                parse=int,
                help="the longest context of one request; without -c the context is -np x N",
            ),
            opt(
                "-fa",
                "--flash-attn",
                field="flash_attn",
                value="on|off|auto",
                env="LLAMA_ARG_FLASH_ATTN",
                parse=values.choice("on", "off", "auto"),
                optional="on",
            ),
            opt(
                "-n",
                "--predict",
                "--n-predict",
                field="n_predict_max",
                env="LLAMA_ARG_N_PREDICT",
                parse=int,
                help="tokens to predict when a request sets no limit, and the most any request gets",
            ),
            switch(
                "-cb",
                "--cont-batching",
                neg=("-nocb", "--no-cont-batching"),
                field="scheduler",
                env="LLAMA_ARG_CONT_BATCHING",
                convert=values.cont_batching,
                help="--no-cont-batching selects the no-cont-batching scheduler",
            ),
            opt("-ctk", "--cache-type-k", field="cache_type_k", value="TYPE", env="LLAMA_ARG_CACHE_TYPE_K"),
            opt("-ctv", "--cache-type-v", field="cache_type_v", value="TYPE", env="LLAMA_ARG_CACHE_TYPE_V"),
            switch(
                "--context-shift", neg=("--no-context-shift",), field="context_shift", env="LLAMA_ARG_CONTEXT_SHIFT"
            ),
            opt("--keep", field="n_keep", parse=int, help="prompt tokens a context shift keeps (-1 all)"),
            opt(
                "--cache-reuse",
                field="cache_reuse",
                env="LLAMA_ARG_CACHE_REUSE",
                parse=int,
                help="min chunk size to reuse from a slot's cache past the common prefix, by shifting "
                "its KV (0 off; default of the request field n_cache_reuse)",
            ),
            opt(
                "-cram",
                "--cache-ram",
                field="cache_ram_mib",
                env="LLAMA_ARG_CACHE_RAM",
                parse=int,
                help="host-memory prompt cache in MiB (0 off, -1 no limit)",
            ),
            switch(
                "--cache-idle-slots",
                neg=("--no-cache-idle-slots",),
                field="cache_idle_slots",
                env="LLAMA_ARG_CACHE_IDLE_SLOTS",
                help="save a slot's KV to the --cache-ram cache whenever a new prompt would lose part of it",
            ),
            switch(
                "--cache-prompt",
                neg=("--no-cache-prompt",),
                field="cache_prompt",
                env="LLAMA_ARG_CACHE_PROMPT",
                help="default of the request field cache_prompt",
            ),
            opt(
                "-r",
                "--reverse-prompt",
                field="stop",
                value="PROMPT",
                many=True,
                help="a stop string for requests that send none (repeatable)",
            ),
            switch("--ignore-eos", field="ignore_eos", help="default of the request field ignore_eos"),
            switch(
                "-sp",
                "--special",
                field="special",
                help="special tokens (<|im_end|>, the EOS, ...) appear as their text in generated output",
            ),
            opt("--slot-save-path", field="slot_save_path", value="PATH", env="LLAMA_ARG_SLOT_SAVE_PATH"),
            switch(
                "--slot-transfer",
                field="slot_transfer",
                env="LLAMACTOR_SLOT_TRANSFER",
                help="allow POST /slots/{id}?action=export and ?action=import: a slot's KV state as bytes, "
                "imported by a server of the same model, KV types and adapters (off: the body can be large)",
            ),
            opt(
                "--api-key",
                field="api_keys",
                value="KEY",
                env="LLAMA_API_KEY",
                parse=values.comma_list,
                many=True,
                convert=values.flatten,
                help="comma-separated keys",
            ),
            opt(
                "--api-key-file",
                field="api_keys",
                value="FNAME",
                env="LLAMA_ARG_API_KEY_FILE",
                parse=values.key_file,
                many=True,
                convert=values.flatten,
                help="one key per line, # comments",
            ),
            switch(
                "--ui",
                "--webui",
                neg=("--no-ui", "--no-webui"),
                field="webui",
                env="LLAMA_ARG_UI",
                help="the live page at GET /",
            ),
            switch(
                "--metrics",
                field="endpoint_metrics",
                env="LLAMA_ARG_ENDPOINT_METRICS",
                help="GET /metrics, Prometheus text (off by default: 501)",
            ),
            switch(
                "--slots",
                neg=("--no-slots",),
                field="endpoint_slots",
                env="LLAMA_ARG_ENDPOINT_SLOTS",
                help="GET /slots (on by default; --no-slots: 501)",
            ),
            opt(
                "--api-prefix",
                field="api_prefix",
                value="PREFIX",
                env="LLAMA_ARG_API_PREFIX",
                help="serve every route, the page included, under this path (/api: /api/health, /api/v1/models)",
            ),
            opt(
                "--path",
                field="static_path",
                value="PATH",
                env="LLAMA_ARG_STATIC_PATH",
                convert=lambda path: path or None,
                help="serve the files of this directory at / instead of the built-in page (index.html for a "
                "directory; the API's routes first)",
            ),
        ),
    ),
    Group(
        "Weights placement",
        Use.CONFIG,
        "-ngl puts layers on the GPUs of a GPU build (make install BACKEND=cuda; auto, the default: all of "
        "them) and is logged and ignored without one, as llama-server warns; -ot/-cmoe/-ncmoe/-ncffn "
        "place the tensors their patterns match in a device's buffer type (an unknown name is exit 2 "
        "listing the available ones)",
        (
            opt(
                "-ngl",
                "--gpu-layers",
                "--n-gpu-layers",
                field="n_gpu_layers",
                env="LLAMA_ARG_N_GPU_LAYERS",
                parse=values.layers,
                help="a number, auto or all (default: auto, every layer on the GPUs; llama-server's fitting "
                "to free memory, -fit, is not built: give a number where the model does not fit)",
            ),
            opt(
                "-mg",
                "--main-gpu",
                field="main_gpu",
                value="INDEX",
                env="LLAMA_ARG_MAIN_GPU",
                parse=int,
                help="the GPU for the whole model with -sm none, or for intermediate results and KV with -sm row",
            ),
            switch(
                "-kvo",
                "--kv-offload",
                neg=("-nkvo", "--no-kv-offload"),
                field="kv_offload",
                env="LLAMA_ARG_KV_OFFLOAD",
                help="-nkvo: the KV cache stays in host memory",
            ),
            switch(
                "--repack",
                neg=("-nr", "--no-repack"),
                field="repack",
                env="LLAMA_ARG_REPACK",
                help="-nr: weights stay in the CPU's plain buffer type (no AMX or repacked layouts)",
            ),
            switch(
                "--no-host",
                field="no_host",
                env="LLAMA_ARG_NO_HOST",
                help="no host buffers for weights on a GPU (llama.cpp's no_host)",
            ),
            switch(
                "--op-offload",
                neg=("--no-op-offload",),
                field="op_offload",
                help="--no-op-offload: ops on host-resident weights are not offloaded to the GPU",
            ),
            switch(
                "--warmup",
                neg=("--no-warmup",),
                field="warmup",
                help="a warm-up decode of each new context before it serves (default on; a build this CPU cannot "
                "run then fails at startup, saying why)",
            ),
            opt(
                "-lm",
                "--load-mode",
                field="load_mode",
                value="MODE",
                env="LLAMA_ARG_LOAD_MODE",
                parse=values.choice(*placement.LOAD_MODES),
                help="how the weights are read: auto (mmap), none (read into memory), mmap, mlock, mmap+mlock, "
                "dio (direct I/O)",
            ),
            switch(
                "--mmap",
                neg=("--no-mmap",),
                field="use_mmap",
                env="LLAMA_ARG_MMAP",
                help="older llama-server: --no-mmap is --load-mode none",
            ),
            switch(
                "--mlock", field="use_mlock", env="LLAMA_ARG_MLOCK", help="older llama-server: --load-mode mmap+mlock"
            ),
            opt(
                "-lzm",
                "--lazy-mode",
                field="lazy_mode",
                value="MODE",
                env="LLAMA_ARG_LAZY_MODE",
                parse=values.choice(*placement.LAZY_MODES),
                help="read the rows of tensors such as per-layer embeddings on demand: on, auto (those over 4 GiB), "
                "off",
            ),
            opt(
                "-ot",
                "--override-tensor",
                field="tensor_overrides",
                value="PATTERN=TYPE,...",
                env="LLAMA_ARG_OVERRIDE_TENSOR",
                parse=placement.parse_override_tensor,
                many=True,
                convert=values.tensor_overrides,
                shared="tensor_overrides",
                help="tensors whose name the regular expression matches go to that buffer type (repeatable)",
            ),
            switch(
                "-cmoe",
                "--cpu-moe",
                field="tensor_overrides",
                env="LLAMA_ARG_CPU_MOE",
                many=True,
                convert=values.tensor_overrides,
                shared="tensor_overrides",
                help="every MoE expert weight in the CPU buffer type",
            ),
            opt(
                "-ncmoe",
                "--n-cpu-moe",
                field="tensor_overrides",
                env="LLAMA_ARG_N_CPU_MOE",
                parse=placement.n_cpu_moe,
                many=True,
                convert=values.tensor_overrides,
                shared="tensor_overrides",
                help="the MoE expert weights of the first N layers in the CPU buffer type",
            ),
            opt(
                "-ncffn",
                "--n-cpu-ffn",
                field="tensor_overrides",
                env="LLAMA_ARG_N_CPU_FFN",
                parse=placement.n_cpu_ffn,
                many=True,
                convert=values.tensor_overrides,
                shared="tensor_overrides",
                help="the dense FFN weights of the first N layers in the CPU buffer type",
            ),
            opt(
                "--rpc",
                field="rpc_servers",
                value="SERVERS",
                env="LLAMA_ARG_RPC",
                parse=values.comma_list,
                help="comma-separated HOST:PORT of ggml-rpc workers",
            ),
            opt(
                "-dev",
                "--device",
                field="devices",
                value="DEVICES",
                env="LLAMA_ARG_DEVICE",
                parse=lambda s: () if s == "none" else values.comma_list(s),
                help="comma-separated devices for the split, e.g. RPC0,CPU (list the local CPU last)",
            ),
            opt(
                "-ts",
                "--tensor-split",
                field="tensor_split",
                value="N0,N1,...",
                env="LLAMA_ARG_TENSOR_SPLIT",
                parse=values.floats,
            ),
            opt(
                "-sm",
                "--split-mode",
                field="split_mode",
                value="MODE",
                env="LLAMA_ARG_SPLIT_MODE",
                help="none | layer | row",
            ),
        ),
    ),
    Group(
        "Chat templates, embeddings",
        Use.CONFIG,
        "templates are Jinja (a jinja2 sandbox): --chat-template takes Jinja source or chatml; with --no-jinja, "
        "also the name of a llama.cpp built-in template (llama3, gemma, mistral-v7, ...), rendered by llama.cpp",
        (
            switch(
                "--jinja",
                neg=("--no-jinja",),
                field="jinja",
                env="LLAMA_ARG_JINJA",
                help="--no-jinja: --chat-template NAME is llama.cpp's built-in template NAME (other templates "
                "stay Jinja)",
            ),
            opt(
                "--chat-template",
                field="chat_template",
                value="JINJA_TEMPLATE",
                env="LLAMA_ARG_CHAT_TEMPLATE",
                help="Jinja source (or chatml) used instead of the GGUF's template; with --no-jinja, the name of "
                "a llama.cpp built-in template",
            ),
            opt("--chat-template-file", field="chat_template_file", value="FILE", env="LLAMA_ARG_CHAT_TEMPLATE_FILE"),
            switch(
                "-v",
                "--verbose",
                "--log-verbose",
                field="verbose",
                help="OpenAI answers carry __verbose (the native answer and the prompt), as llama-server's; "
                "logging is set by --log-format",
            ),
            switch(
                "--prefill-assistant",
                neg=("--no-prefill-assistant",),
                field="prefill_assistant",
                env="LLAMA_ARG_PREFILL_ASSISTANT",
                help="a chat that ends with the assistant's message continues it (on by default)",
            ),
            opt(
                "-rea",
                "--reasoning",
                field="reasoning",
                value="on|off|auto",
                env="LLAMA_ARG_REASONING",
                parse=values.reasoning,
                help="thinking in the chat: on or off sets the template's enable_thinking (a request's "
                "chat_template_kwargs still wins); auto: the template's own default",
            ),
            opt(
                "--chat-template-kwargs",
                field="chat_template_kwargs",
                value="JSON",
                env="LLAMA_ARG_CHAT_TEMPLATE_KWARGS",
                parse=values.json_object,
                help="extra variables for the template",
            ),
            opt(
                "--reasoning-format",
                field="reasoning_format",
                value="FORMAT",
                env="LLAMA_ARG_THINK",
                parse=values.choice("auto", "none", "deepseek", "deepseek-legacy"),
            ),
            opt("--reasoning-budget", field="reasoning_budget", env="LLAMA_ARG_THINK_BUDGET", parse=int),
            switch("--embedding", "--embeddings", field="embedding", env="LLAMA_ARG_EMBEDDINGS"),
            opt(
                "--pooling",
                field="pooling",
                value="TYPE",
                env="LLAMA_ARG_POOLING",
                parse=values.choice("none", "mean", "cls", "last", "rank"),
            ),
            opt("--embd-normalize", field="embd_normalize", parse=int),
            switch(
                "--rerank",
                "--reranking",
                field="pooling",
                env="LLAMA_ARG_RERANKING",
                convert=lambda on: Sets({"embedding": True, "pooling": "rank"}) if on else None,
                help="embeddings with rank pooling: /rerank",
            ),
        ),
    ),
    Group(
        "CORS, POST /props",
        Use.CONFIG,
        "llama-server's defaults: every response allows origin * (the Origin "
        "echoed with credentials), OPTIONS is answered on every path without a key",
        (
            opt(
                "--cors-origins",
                field="cors_origins",
                value="ORIGINS",
                env="LLAMA_ARG_CORS_ORIGINS",
                help="comma-separated, or localhost",
            ),
            opt("--cors-methods", field="cors_methods", value="METHODS", env="LLAMA_ARG_CORS_METHODS"),
            opt("--cors-headers", field="cors_headers", value="HEADERS", env="LLAMA_ARG_CORS_HEADERS"),
            switch(
                "--cors-credentials",
                neg=("--no-cors-credentials",),
                field="cors_credentials",
                env="LLAMA_ARG_CORS_CREDENTIALS",
            ),
            switch(
                "--props",
                field="endpoint_props",
                env="LLAMA_ARG_ENDPOINT_PROPS",
                help="allow POST /props (it changes nothing, as in llama-server)",
            ),
        ),
    ),
    Group(
        "LoRA adapters",
        Use.CONFIG,
        "as in llama-server: loaded once, applied per request (request field "
        "lora, GET/POST /lora-adapters); ids follow the command line",
        (
            opt(
                "--lora",
                field="lora",
                value="FNAME",
                parse=values.lora,
                many=True,
                convert=values.flatten,
                shared="lora",
                help="comma-separated adapter files, global scale 1 (repeatable)",
            ),
            opt(
                "--lora-scaled",
                field="lora",
                value="FNAME:SCALE,...",
                parse=values.lora_scaled,
                many=True,
                convert=values.flatten,
                shared="lora",
                help="adapter files with their global scales (repeatable)",
            ),
            switch(
                "--lora-init-without-apply",
                field="lora_init_without_apply",
                help="load the adapters at global scale 0 (set them with POST /lora-adapters)",
            ),
        ),
    ),
    Group(
        "Model overrides",
        Use.CONFIG,
        "as in llama-server: --override-kv wherever the model loads (the draft model and the API "
        "process's vocabulary too); the RoPE/YaRN values in every context (groups, draft, embedding)",
        (
            opt(
                "--rope-scaling",
                field="rope_scaling",
                value="{none,linear,yarn}",
                env="LLAMA_ARG_ROPE_SCALING_TYPE",
                parse=values.choice(*ROPE_SCALING_TYPES),
                help="RoPE frequency scaling method (default: the model's, else linear)",
            ),
            opt(
                "--rope-scale",
                field="rope_freq_scale",
                env="LLAMA_ARG_ROPE_SCALE",
                parse=values.rope_scale,
                help="RoPE context scaling factor: expands the context N times (--rope-freq-scale 1/N)",
            ),
            opt(
                "--rope-freq-base",
                field="rope_freq_base",
                env="LLAMA_ARG_ROPE_FREQ_BASE",
                parse=float,
                help="RoPE base frequency (default: the model's)",
            ),
            opt(
                "--rope-freq-scale",
                field="rope_freq_scale",
                env="LLAMA_ARG_ROPE_FREQ_SCALE",
                parse=float,
                help="RoPE frequency scaling factor: expands the context 1/N times (default: the model's)",
            ),
            opt(
                "--yarn-orig-ctx",
                field="yarn_orig_ctx",
                env="LLAMA_ARG_YARN_ORIG_CTX",
                parse=int,
                help="YaRN: the model's original context (0: its training context)",
            ),
            opt(
                "--yarn-ext-factor",
                field="yarn_ext_factor",
                env="LLAMA_ARG_YARN_EXT_FACTOR",
                parse=float,
                help="YaRN: extrapolation mix factor (0.0: full interpolation; -1: the model's)",
            ),
            opt(
                "--yarn-attn-factor",
                field="yarn_attn_factor",
                env="LLAMA_ARG_YARN_ATTN_FACTOR",
                parse=float,
                help="YaRN: scale sqrt(t) or attention magnitude (-1: the model's)",
            ),
            opt(
                "--yarn-beta-slow",
                field="yarn_beta_slow",
                env="LLAMA_ARG_YARN_BETA_SLOW",
                parse=float,
                help="YaRN: high correction dim or alpha (-1: the model's)",
            ),
            opt(
                "--yarn-beta-fast",
                field="yarn_beta_fast",
                env="LLAMA_ARG_YARN_BETA_FAST",
                parse=float,
                help="YaRN: low correction dim or beta (-1: the model's)",
            ),
            opt(
                "--override-kv",
                field="kv_overrides",
                value="KEY=TYPE:VALUE,...",
                parse=values.kv_overrides,
                many=True,
                convert=values.flatten,
                help="model metadata read instead of the GGUF's; types int, float, bool, str "
                "(comma-separated, repeatable), e.g. tokenizer.ggml.add_bos_token=bool:false",
            ),
        ),
    ),
    Group(
        "Control vectors",
        Use.CONFIG,
        "as in llama-server: the files' direction vectors, each times its scale, summed into one and "
        "set on every context of the model; server-wide (llama-server has none per request)",
        (
            opt(
                "--control-vector",
                field="control_vectors",
                value="FNAME",
                parse=values.control_vectors,
                many=True,
                convert=values.flatten,
                shared="control_vectors",
                help="control vector files, scale 1 (comma-separated, repeatable)",
            ),
            opt(
                "--control-vector-scaled",
                field="control_vectors",
                value="FNAME:SCALE,...",
                parse=values.control_vectors_scaled,
                many=True,
                convert=values.flatten,
                shared="control_vectors",
                help="control vector files with their scales (repeatable)",
            ),
            opt(
                "--control-vector-layer-range",
                field="control_vector_layers",
                value="START END",
                parse=int,
                convert=tuple,
                help="the layers the control vector applies to, both included (default: all)",
            ),
        ),
    ),
    Group(
        "Speculative decoding",
        Use.CONFIG,
        "per group: ngram-simple (prompt lookup), a draft model (-md, draft-simple), one draft context per "
        "group, ngram-cache (lookup decoding from llama.cpp's n-gram cache files, drafts of up to 8 tokens as "
        "llama-server's) or ngram-mod (--spec-default); one kind at a time; ngram-map-k and ngram-map-k4v are "
        "refused by --spec-type; --draft-max/--draft-min are older llama-server's names of "
        "--spec-draft-n-max/-n-min",
        (
            opt(
                "--spec-type",
                field="spec_type",
                value="TYPES",
                env="LLAMA_ARG_SPEC_TYPE",
                parse=values.spec_type,
                help="none | ngram-simple | draft-simple | ngram-cache | ngram-mod (-md alone means draft-simple, "
                "-lcs/-lcd alone ngram-cache)",
            ),
            opt(
                "-lcs",
                "--lookup-cache-static",
                field="lookup_cache_static",
                value="FNAME",
                help="ngram-cache: a llama.cpp n-gram cache file (llama-lookup-create's), read only",
            ),
            opt(
                "-lcd",
                "--lookup-cache-dynamic",
                field="lookup_cache_dynamic",
                value="FNAME",
                help="ngram-cache: an n-gram cache file read at startup if it exists, filled with every request's "
                "tokens and written back when the server stops",
            ),
            switch(
                "--spec-default",
                field="spec_type",
                convert=values.spec_default,
                help="llama-server's default speculation: ngram-mod with a 24-token match and drafts of 48 to 64 "
                "tokens",
            ),
            opt(
                "--spec-ngram-mod-n-match",
                field="spec_ngram_mod_n_match",
                parse=int,
                help="ngram-mod: the window looked up, in tokens (default 24)",
            ),
            opt(
                "--spec-ngram-mod-n-min",
                field="spec_ngram_mod_n_min",
                parse=int,
                help="ngram-mod: shorter drafts are dropped (default 48)",
            ),
            opt(
                "--spec-ngram-mod-n-max",
                field="spec_ngram_mod_n_max",
                parse=int,
                help="ngram-mod: the longest draft (default 64)",
            ),
            opt(
                "--spec-ngram-simple-size-n",
                field="spec_ngram_size_n",
                parse=int,
                help="ngram-simple: tokens looked up in the slot's history (default 12)",
            ),
            opt(
                "--spec-ngram-simple-size-m",
                field="spec_ngram_size_m",
                parse=int,
                help="ngram-simple: the longest draft (default 48)",
            ),
            opt(
                "--spec-draft-model",
                "-md",
                "--model-draft",
                field="spec_draft_model",
                value="FNAME",
                env="LLAMA_ARG_SPEC_DRAFT_MODEL",
                help="the draft model; its vocabulary must be the target's",
            ),
            opt(
                "--spec-draft-n-max",
                field="spec_draft_n_max",
                env="LLAMA_ARG_SPEC_DRAFT_N_MAX",
                parse=int,
                help="the longest draft-model draft (default 3)",
            ),
            opt(
                "--spec-draft-n-min",
                field="spec_draft_n_min",
                env="LLAMA_ARG_SPEC_DRAFT_N_MIN",
                parse=int,
                help="shorter drafts (either kind) are not verified",
            ),
            opt(
                "--draft",
                "--draft-n",
                "--draft-max",
                field="spec_draft_n_max",
                env="LLAMA_ARG_DRAFT_MAX",
                parse=int,
                help="older llama-server's --spec-draft-n-max",
            ),
            opt(
                "--draft-min",
                "--draft-n-min",
                field="spec_draft_n_min",
                env="LLAMA_ARG_DRAFT_MIN",
                parse=int,
                help="older llama-server's --spec-draft-n-min",
            ),
            opt(
                "--spec-draft-p-min",
                "--draft-p-min",
                field="spec_draft_p_min",
                value="P",
                env="LLAMA_ARG_SPEC_DRAFT_P_MIN",
                parse=float,
                help="the draft model stops below this probability",
            ),
            opt(
                "--spec-draft-ngl",
                "-ngld",
                "--gpu-layers-draft",
                "--n-gpu-layers-draft",
                field="spec_draft_n_gpu_layers",
                env="LLAMA_ARG_N_GPU_LAYERS_DRAFT",
                parse=values.layers,
                help="the draft's layers on the GPU (default: as -ngl)",
            ),
            opt(
                "--spec-draft-device",
                "-devd",
                "--device-draft",
                field="spec_draft_devices",
                value="DEVICES",
                parse=lambda s: () if s == "none" else values.comma_list(s),
                help="the draft model's devices (default: local)",
            ),
        ),
    ),
    Group(
        "Streaming",
        Use.CONFIG,
        "as in llama-server: a stream silent that long gets an SSE comment ping",
        (
            opt(
                "--sse-ping-interval",
                field="sse_ping_interval",
                value="N",
                env="LLAMA_ARG_SSE_PING_INTERVAL",
                parse=int,
                help="seconds; -1 (or 0) sends none; the request field sse_ping_interval overrides it",
            ),
        ),
    ),
    Group(
        "Sampling defaults",
        Use.SAMPLING,
        "a request that leaves the field out gets this value (native and "
        "OpenAI APIs, Runtime.complete); /props shows them",
        (
            opt(
                "--temp",
                "--temperature",
                field="temperature",
                env="LLAMA_ARG_TEMPERATURE",
                parse=lambda s: max(float(s), 0.0),
            ),
            opt("--top-k", field="top_k", env="LLAMA_ARG_TOP_K", parse=int),
            opt("--top-p", field="top_p", env="LLAMA_ARG_TOP_P", parse=float),
            opt("--min-p", field="min_p", env="LLAMA_ARG_MIN_P", parse=float),
            opt("--top-nsigma", "--top-n-sigma", field="top_n_sigma", parse=float),
            opt("--xtc-probability", field="xtc_probability", parse=float),
            opt("--xtc-threshold", field="xtc_threshold", parse=float),
            opt("--typical", "--typical-p", field="typical_p", parse=float),
            opt("--repeat-last-n", field="repeat_last_n", parse=int),
            opt("--repeat-penalty", field="repeat_penalty", env="LLAMA_ARG_REPEAT_PENALTY", parse=float),
            opt("--presence-penalty", field="presence_penalty", env="LLAMA_ARG_PRESENCE_PENALTY", parse=float),
            opt("--frequency-penalty", field="frequency_penalty", env="LLAMA_ARG_FREQUENCY_PENALTY", parse=float),
            opt("--dry-multiplier", field="dry_multiplier", parse=float),
            opt("--dry-base", field="dry_base", parse=float),
            opt("--dry-allowed-length", field="dry_allowed_length", parse=int),
            opt("--dry-penalty-last-n", field="dry_penalty_last_n", parse=int),
            opt(
                "--dry-sequence-breaker",
                field="dry_sequence_breakers",
                value="STRING",
                many=True,
                convert=values.dry_breakers,
            ),
            opt("--dynatemp-range", field="dynatemp_range", parse=float),
            opt("--dynatemp-exp", field="dynatemp_exponent", parse=float),
            opt("--mirostat", field="mirostat", parse=int),
            opt("--mirostat-lr", field="mirostat_eta", parse=float),
            opt("--mirostat-ent", field="mirostat_tau", parse=float),
            opt(
                "--adaptive-target",
                field="adaptive_target",
                parse=float,
                help="adaptive-p (samplers adaptive_p): tokens near this probability, 0 to 1 (negative: off)",
            ),
            opt(
                "--adaptive-decay",
                field="adaptive_decay",
                parse=float,
                help="adaptive-p: the target's decay, 0 to 0.99",
            ),
            opt("-s", "--seed", field="seed", value="SEED", parse=values.seed, help="-1 = random"),
            opt("--samplers", field="samplers", value="SAMPLERS", parse=values.samplers, help="names separated by ';'"),
            opt("--sampler-seq", "--sampling-seq", field="samplers", value="SEQUENCE", parse=values.sampler_chars),
            opt(
                "-l", "--logit-bias", field="logit_bias", value="TOKEN_ID(+/-)BIAS", parse=values.logit_bias, many=True
            ),
            opt("--grammar", field="grammar", value="GRAMMAR"),
            opt("--grammar-file", field="grammar", value="FNAME", parse=values.read),
            opt("-j", "--json-schema", field="grammar", value="SCHEMA", parse=values.schema_grammar),
            opt(
                "-jf",
                "--json-schema-file",
                field="grammar",
                value="FILE",
                parse=lambda p: values.schema_grammar(values.read(p)),
            ),
        ),
    ),
    Group(
        "Process",
        Use.PROCESS,
        "--log-jsonl picks JSON logs; --ssl-* serve HTTPS",
        (
            opt(
                "--host",
                field="hosts",
                value="HOST",
                env="LLAMA_ARG_HOST",
                parse=values.hosts,
                help="IP addresses to listen on, comma-separated (UNIX sockets are not supported)",
            ),
            opt("--port", field="port", value="PORT", env="LLAMA_ARG_PORT", parse=int),
            opt(
                "-to",
                "--timeout",
                field="timeout",
                env="LLAMA_ARG_TIMEOUT",
                parse=values.timeout,
                help="seconds a client has to send a request's whole body, and that one write to a client "
                "may wait (default 600, as llama-server's read and write timeout)",
            ),
            opt("--ssl-key-file", field="ssl_key_file", value="FNAME", env="LLAMA_ARG_SSL_KEY_FILE"),
            opt("--ssl-cert-file", field="ssl_cert_file", value="FNAME", env="LLAMA_ARG_SSL_CERT_FILE"),
            switch(
                "--log-jsonl",
                neg=("--no-log-jsonl",),
                field="log_format",
                env="LLAMA_ARG_LOG_JSONL",
                convert=lambda on: "json" if on else "text",
            ),
            switch("--list-devices", field="list_devices", help="print the devices and exit"),
            switch("--version", field="version", help="print the version and exit"),
            switch(
                "--completion-bash",
                field="completion_bash",
                help="print a bash completion script for llamactor serve and exit (source it)",
            ),
        ),
    ),
    Group(
        "Many models (router mode)",
        Use.PROCESS,
        "llama-server's router mode: started without -m, the server serves every model of --models-dir "
        "and --models-preset, each in an engine process of its own, routed by the request's model field "
        "(with -m these are logged and ignored)",
        (
            opt(
                "--models-dir",
                field="models_dir",
                value="PATH",
                env="LLAMA_ARG_MODELS_DIR",
                help="a folder of models: each .gguf file, and each subfolder holding one, is a model named after it",
            ),
            opt(
                "--models-preset",
                field="models_preset",
                value="PATH",
                env="LLAMA_ARG_MODELS_PRESET",
                help="an INI file: a [section] per model, its keys llama-server's flags (model = FILE)",
            ),
            opt(
                "--models-max",
                field="models_max",
                env="LLAMA_ARG_MODELS_MAX",
                parse=int,
                help="models loaded at once (default 4, 0 = no limit); past it the least recently used idle "
                "model is unloaded",
            ),
            switch(
                "--models-autoload",
                neg=("--no-models-autoload",),
                field="models_autoload",
                env="LLAMA_ARG_MODELS_AUTOLOAD",
                help="load a model on its first request (default on; ?autoload= overrides per request)",
            ),
        ),
    ),
    Group(
        "Sleeping on idle",
        Use.CONFIG,
        "as in llama-server: an idle engine unloads its model (here its process exits) and the next request "
        "loads it again; /props says is_sleeping",
        (
            opt(
                "--sleep-idle-seconds",
                field="sleep_idle_seconds",
                value="SECONDS",
                parse=values.sleep_seconds,
                help="seconds without a request before the engine sleeps (default -1: never)",
            ),
        ),
    ),
    # ---- accepted, with one log line ----------------------------------------------------
    Group(
        "Thread placement",
        Use.IGNORE,
        "thread affinity, priority and polling are left to the OS",
        (
            opt("-C", "--cpu-mask", value="M"),
            opt("-Cr", "--cpu-range", value="lo-hi"),
            opt("--cpu-strict", value="<0|1>", parse=int, ok=values.is_one_of(0)),
            opt("--prio", parse=int, ok=values.is_one_of(0)),
            opt("--poll", value="<0...100>"),
            opt("-Cb", "--cpu-mask-batch", value="M"),
            opt("-Crb", "--cpu-range-batch", value="lo-hi"),
            opt("--cpu-strict-batch", parse=int, ok=values.is_one_of(0)),
            opt("--prio-batch", parse=int, ok=values.is_one_of(0)),
            opt("--poll-batch", value="<0|1>"),
            opt("--numa", value="TYPE", env="LLAMA_ARG_NUMA"),
        ),
    ),
    Group(
        "Logging",
        Use.CONFIG,
        "every process of the server (API, engine, replicas) logs as these say",
        (
            switch(
                "--log-disable",
                field="log_level",
                convert=lambda on: "off" if on else None,
                help="no log lines",
            ),
            opt(
                "--log-file",
                field="log_file",
                value="FNAME",
                env="LLAMA_ARG_LOG_FILE",
                help="each log line is also appended to FNAME",
            ),
            opt(
                "--log-colors",
                field="log_colors",
                value="on|off|auto",
                env="LLAMA_ARG_LOG_COLORS",
                parse=values.choice("on", "off", "auto"),
                help="colours in text logs (auto: when stderr is a terminal)",
            ),
            opt(
                "-lv",
                "--verbosity",
                "--log-verbosity",
                field="log_level",
                env="LLAMA_ARG_LOG_VERBOSITY",
                parse=int,
                convert=values.verbosity_level,
                help="llama-server's thresholds: 0 output only, 1 errors, 2 warnings, 3 info (default), 4 debug",
            ),
            switch(
                "--log-prefix",
                neg=("--no-log-prefix",),
                field="log_prefix",
                env="LLAMA_ARG_LOG_PREFIX",
                help="each line names its level (on by default)",
            ),
            switch(
                "--log-timestamps",
                neg=("--no-log-timestamps",),
                field="log_timestamps",
                env="LLAMA_ARG_LOG_TIMESTAMPS",
                help="each line has its time (on by default)",
            ),
        ),
    ),
    Group(
        "Logging details",
        Use.IGNORE,
        _LOGS,
        (
            opt("--log-prompts-dir", value="PATH"),
            switch("--perf", neg=("--no-perf",), env="LLAMA_ARG_PERF", ok=_off),
        ),
    ),
    Group(
        "Downloads",
        Use.IGNORE,
        "llamactor never downloads anything: models are local files (-m)",
        (
            switch("--offline", env="LLAMA_ARG_OFFLINE"),
            opt("-hft", "--hf-token", value="TOKEN"),
            switch("--mmproj-auto", neg=("--no-mmproj", "--no-mmproj-auto"), env="LLAMA_ARG_MMPROJ_AUTO", ok=_off),
        ),
    ),
    Group(
        "Memory tuning",
        Use.IGNORE,
        "llama.cpp's defaults are used for these",
        (
            opt("-fit", "--fit", value="on|off", env="LLAMA_ARG_FIT", ok=values.is_one_of("off")),
            opt("-fitt", "--fit-target", value="MiB0,MiB1,...", env="LLAMA_ARG_FIT_TARGET"),
            opt("-fitc", "--fit-ctx", env="LLAMA_ARG_FIT_CTX"),
            switch("--check-tensors"),
            opt("-dt", "--defrag-thold", env="LLAMA_ARG_DEFRAG_THOLD", help="deprecated in llama.cpp"),
        ),
    ),
    Group(
        "Prompt cache",
        Use.IGNORE,
        "the prompt cache is each slot's KV, its window checkpoints and the host-memory cache (--cache-ram)",
        (
            opt(
                "-sps",
                "--slot-prompt-similarity",
                value="SIMILARITY",
                help="slots are chosen by the longest cached prefix",
            ),
        ),
    ),
    Group(
        "HTTP server",
        Use.IGNORE,
        "hypercorn on asyncio serves HTTP; these knobs have no counterpart",
        (
            opt(
                "--threads-http",
                env="LLAMA_ARG_THREADS_HTTP",
                help="one asyncio event loop serves every connection: there are no HTTP threads to size",
            ),
            switch("--reuse-port", env="LLAMA_ARG_REUSE_PORT"),
        ),
    ),
    Group(
        "Web UI settings",
        Use.IGNORE,
        "llamactor's page at GET / has no settings",
        (
            opt("--ui-config", "--webui-config", value="JSON", env="LLAMA_ARG_UI_CONFIG"),
            opt("--ui-config-file", "--webui-config-file", value="PATH", env="LLAMA_ARG_UI_CONFIG_FILE"),
        ),
    ),
    Group(
        "Chat parsing",
        Use.IGNORE,
        "llamactor's chat handling has no such switch",
        (
            opt("--reasoning-effort", value="LEVEL", env="LLAMA_ARG_REASONING_EFFORT", ok=values.is_one_of("default")),
            opt("--reasoning-budget-message", value="MESSAGE", env="LLAMA_ARG_THINK_BUDGET_MESSAGE"),
            switch("--reasoning-preserve", neg=("--no-reasoning-preserve",), env="LLAMA_ARG_REASONING_PRESERVE"),
            switch("--skip-chat-parsing", neg=("--no-skip-chat-parsing",), env="LLAMA_ARG_SKIP_CHAT_PARSING", ok=_off),
            switch("-e", "--escape", neg=("--no-escape",), help="prompts come over HTTP, not from the command line"),
            switch("--spm-infill", help="there is no /infill endpoint"),
        ),
    ),
    Group(
        "Multimodal",
        Use.CONFIG,
        "image and audio input: image_url and input_audio parts (data:, http(s):// and, with --media-path, "
        "file:// URLs), Anthropic image blocks, Responses input_image parts, the native prompt's "
        "multimodal_data, /v1/audio/transcriptions",
        (
            opt("-mm", "--mmproj", field="mmproj", value="FILE", env="LLAMA_ARG_MMPROJ"),
            opt(
                "--media-path",
                field="media_path",
                value="PATH",
                help="directory file:// media URLs are read from (paths relative to it, never out of it); "
                "default: file:// URLs refused",
            ),
            opt(
                "--allowed-media-domains",
                field="allowed_media_domains",
                value="HOST,...",
                env="LLAMACTOR_ALLOWED_MEDIA_DOMAINS",
                parse=values.comma_list,
                many=True,
                convert=values.flatten,
                help="the only hosts http(s) media URLs may name, on every redirect too (as vLLM's; "
                "comma-separated, repeatable; default: any host at a public address)",
            ),
            switch(
                "--allow-private-media-urls",
                field="allow_private_media_urls",
                env="LLAMACTOR_ALLOW_PRIVATE_MEDIA_URLS",
                help="media URLs may reach loopback, private (10/8, 172.16/12, 192.168/16, fc00::/7) and "
                "CGNAT addresses (refused by default; link-local, where cloud metadata is, stays refused)",
            ),
            switch(
                "--mmproj-offload",
                neg=("--no-mmproj-offload",),
                field="mmproj_offload",
                env="LLAMA_ARG_MMPROJ_OFFLOAD",
            ),
            opt(
                "--image-min-tokens",
                field="image_min_tokens",
                env="LLAMA_ARG_IMAGE_MIN_TOKENS",
                parse=int,
                help="fewest tokens an image takes, projectors with dynamic resolution only (default: the file's)",
            ),
            opt(
                "--image-max-tokens",
                field="image_max_tokens",
                env="LLAMA_ARG_IMAGE_MAX_TOKENS",
                parse=int,
                help="most tokens an image takes, projectors with dynamic resolution only (default: the file's)",
            ),
            opt(
                "--mtmd-batch-max-tokens",
                field="mtmd_batch_max_tokens",
                env="LLAMA_ARG_MTMD_BATCH_MAX_TOKENS",
                parse=int,
                help="image tokens encoded in one batch (default: 1024)",
            ),
        ),
    ),
    Group(
        "Multimodal tuning",
        Use.IGNORE,
        _MTMD,
        (
            opt("-mmdev", "--mmproj-device", value="DEVICE", env="MTMD_BACKEND_DEVICE"),
            opt("--video-fps", env="LLAMA_ARG_VIDEO_FPS"),
            opt("--video-timestamp-interval", env="LLAMA_ARG_VIDEO_TIMESTAMP_INTERVAL"),
            opt("--video-ffmpeg-dir", value="DIR", env="LLAMA_ARG_VIDEO_FFMPEG_DIR"),
        ),
    ),
    Group(
        "Sampling backends",
        Use.IGNORE,
        "only meaningful for GPU sampling",
        (switch("-bs", "--backend-sampling", env="LLAMA_ARG_BACKEND_SAMPLING", help="sampling runs on the CPU"),),
    ),
    Group(
        "Speculative tuning",
        Use.IGNORE,
        _DRAFT,
        (
            opt("--spec-draft-threads", "-td", "--threads-draft"),
            opt("--spec-draft-threads-batch", "-tbd", "--threads-batch-draft"),
            opt("--spec-draft-cpu-mask", "-Cd", "--cpu-mask-draft", value="M"),
            opt("--spec-draft-cpu-range", "-Crd", "--cpu-range-draft", value="lo-hi"),
            opt("--spec-draft-cpu-strict", "--cpu-strict-draft", value="<0|1>"),
            opt("--spec-draft-prio", "--prio-draft"),
            opt("--spec-draft-poll", "--poll-draft", value="<0|1>"),
            opt("--spec-draft-cpu-mask-batch", "-Cbd", "--cpu-mask-batch-draft", value="M"),
            opt("--spec-draft-cpu-strict-batch", "--cpu-strict-batch-draft", value="<0|1>"),
            opt("--spec-draft-prio-batch", "--prio-batch-draft"),
            opt("--spec-draft-poll-batch", "--poll-batch-draft", value="<0|1>"),
            opt(
                "--spec-draft-type-k",
                "-ctkd",
                "--cache-type-k-draft",
                value="TYPE",
                env="LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K",
            ),
            opt(
                "--spec-draft-type-v",
                "-ctvd",
                "--cache-type-v-draft",
                value="TYPE",
                env="LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V",
            ),
            opt("--spec-draft-override-tensor", "-otd", "--override-tensor-draft", value="PATTERN=TYPE"),
            switch("--spec-draft-cpu-moe", "-cmoed", "--cpu-moe-draft", env="LLAMA_ARG_SPEC_DRAFT_CPU_MOE"),
            opt(
                "--spec-draft-n-cpu-moe",
                "--spec-draft-ncmoe",
                "-ncmoed",
                "--n-cpu-moe-draft",
                env="LLAMA_ARG_SPEC_DRAFT_N_CPU_MOE",
            ),
            opt("--spec-synth-len", value="L", env="LLAMA_ARG_SPEC_SYNTH_LEN"),
            opt("--spec-synth-rates", value="P0,P1,...", env="LLAMA_ARG_SPEC_SYNTH_RATES"),
            opt("--spec-draft-p-split", "--draft-p-split", value="P", env="LLAMA_ARG_SPEC_DRAFT_P_SPLIT"),
            switch(
                "--spec-draft-backend-sampling",
                neg=("--no-spec-draft-backend-sampling",),
                env="LLAMA_ARG_SPEC_DRAFT_BACKEND_SAMPLING",
            ),
        ),
    ),
    Group(
        "N-gram tuning",
        Use.IGNORE,
        "tuning of n-gram kinds not built (--spec-type refuses them); ngram-simple's "
        "min-hits is unused in llama.cpp too",
        (
            *(
                opt(f"--spec-ngram-{name}")
                for name in (
                    "simple-min-hits",
                    "map-k-size-n",
                    "map-k-size-m",
                    "map-k-min-hits",
                    "map-k4v-size-n",
                    "map-k4v-size-m",
                    "map-k4v-min-hits",
                )
            ),
        ),
    ),
    # ---- refused: exit code 2 naming them ---------------------------------------------
    Group(
        "Draft model sources",
        Use.REFUSE,
        "llamactor downloads no draft model: a draft model is a local file (-md)",
        (opt("--spec-draft-hf", "-hfd", "-hfrd", "--hf-repo-draft", value="REPO", env="LLAMA_ARG_SPEC_DRAFT_HF_REPO"),),
    ),
    Group(
        "Removed from llama-server",
        Use.REFUSE,
        "removed from llama-server too (see its --help)",
        (
            opt("--spec-ngram-size-n"),
            opt("--spec-ngram-size-m"),
            opt("--spec-ngram-min-hits"),
            opt("-gan", "--grp-attn-n"),
            opt("-gaw", "--grp-attn-w"),
        ),
    ),
    Group(
        "Multimodal sources",
        Use.REFUSE,
        "llamactor downloads no projector: a projector is a local file (--mmproj)",
        (opt("-mmu", "--mmproj-url", value="URL", env="LLAMA_ARG_MMPROJ_URL"),),
    ),
    Group(
        "Model sources",
        Use.REFUSE,
        "llamactor never downloads models: pass -m with a local GGUF file",
        (
            opt("-mu", "--model-url", value="URL", env="LLAMA_ARG_MODEL_URL"),
            opt("-dr", "--docker-repo", value="REPO", env="LLAMA_ARG_DOCKER_REPO"),
            opt("-hf", "-hfr", "--hf-repo", value="REPO", env="LLAMA_ARG_HF_REPO"),
            opt("-hff", "--hf-file", value="FILE", env="LLAMA_ARG_HF_FILE"),
            switch("-cl", "--cache-list"),
            *(
                switch(f"--{name}")
                for name in (
                    "embd-gemma-default",
                    "fim-qwen-1.5b-default",
                    "fim-qwen-3b-default",
                    "fim-qwen-7b-default",
                    "fim-qwen-7b-spec",
                    "fim-qwen-14b-spec",
                    "fim-qwen-30b-default",
                    "gpt-oss-20b-default",
                    "gpt-oss-120b-default",
                    "vision-gemma-4b-default",
                    "vision-gemma-12b-default",
                )
            ),
        ),
    ),
    Group(
        "Agent tools, MCP servers, CORS proxy",
        Use.CONFIG,
        "experimental, as in llama-server: they refuse to start without --api-key (or --insecure-tools); "
        "with any of them on, --cors-origins defaults to localhost",
        (
            opt(
                "--tools",
                field="server_tools",
                value="TOOL1,TOOL2,...",
                env="LLAMA_ARG_TOOLS",
                parse=agent_tools.tools_flag,
                help="built-in tools served at /tools, or all: " + ", ".join(agent_tools.TOOL_NAMES),
            ),
            opt(
                "--tools-runtime",
                field="tools_runtime",
                value="OPTION",
                env="LLAMA_ARG_TOOLS_RUNTIME",
                parse=agent_tools.tools_runtime_flag,
                convert=agent_tools.tools_runtime_program,
                help="run the tools in docker:IMAGE, podman:IMAGE, docker-container:ID, podman-container:ID or "
                "ssh:TARGET (default: the host)",
            ),
            opt(
                "--mcp-servers-config",
                field="mcp_servers_config",
                value="PATH",
                env="LLAMA_ARG_MCP_SERVERS_CONFIG",
                convert=agent_tools.mcp_config_file_check,
                help="JSON file of MCP servers (Cursor's mcpServers format): their tools at /tools",
            ),
            opt(
                "--mcp-servers-json",
                field="mcp_servers_json",
                value="JSON",
                env="LLAMA_ARG_MCP_SERVERS_JSON",
                parse=agent_tools.mcp_config_json_flag,
                help="the same, inline",
            ),
            switch(
                "--ui-mcp-proxy",
                "--webui-mcp-proxy",
                neg=("--no-ui-mcp-proxy", "--no-webui-mcp-proxy"),
                field="ui_mcp_proxy",
                env="LLAMA_ARG_UI_MCP_PROXY",
                help="/cors-proxy forwards requests (403 when off)",
            ),
            opt(
                "--ui-mcp-proxy-allowed-hosts",
                field="ui_mcp_proxy_allowed_hosts",
                value="HOST,...",
                env="LLAMACTOR_UI_MCP_PROXY_ALLOWED_HOSTS",
                parse=values.comma_list,
                many=True,
                convert=values.flatten,
                help="the only hosts /cors-proxy forwards to, on every redirect too (comma-separated, "
                "repeatable; default: any host at a public address)",
            ),
            switch(
                "--ui-mcp-proxy-allow-private",
                field="ui_mcp_proxy_allow_private",
                env="LLAMACTOR_UI_MCP_PROXY_ALLOW_PRIVATE",
                help="/cors-proxy may reach loopback, private and CGNAT addresses (MCP servers on this "
                "machine or its network; refused by default)",
            ),
            opt(
                "--allowed-hosts",
                field="allowed_hosts",
                value="HOST,...",
                env="LLAMACTOR_ALLOWED_HOSTS",
                parse=values.comma_list,
                many=True,
                convert=values.flatten,
                help="Host header names /tools and /cors-proxy answer under, besides IP addresses, localhost "
                "and the --host names (a name a page rebound to this server's address is refused)",
            ),
            switch(
                "--insecure-tools",
                field="insecure_tools",
                env="LLAMACTOR_INSECURE_TOOLS",
                help="allow --tools, MCP servers, --ui-mcp-proxy and --agent without --api-key (without "
                "it they refuse to start): any client that reaches the server runs them",
            ),
            switch(
                "-ag",
                "--agent",
                neg=("-no-ag", "--no-agent"),
                field="server_tools",
                env="LLAMA_ARG_AGENT",
                convert=lambda on: Sets({"server_tools": ("all",) if on else (), "ui_mcp_proxy": on}),
                help="all the tools and the CORS proxy",
            ),
        ),
    ),
    # ---- llamactor's own ----------------------------------------------------------------
    Group(
        "llamactor process",
        Use.PROCESS,
        "",
        (
            opt(
                "--log-format",
                field="log_format",
                value="auto|json|text",
                env="LLAMACTOR_LOG_FORMAT",
                parse=values.choice("auto", "json", "text"),
            ),
        ),
    ),
    Group(
        "llamactor",
        Use.CONFIG,
        "",
        (
            opt(
                "--pipeline-groups",
                field="pipeline_groups",
                env="LLAMA_ARG_PIPELINE_GROUPS",
                parse=int,
                help="N contexts over one model's weights (pipeline groups: N batches in flight, for a layer split)",
            ),
            opt(
                "--scheduler",
                field="scheduler",
                value="NAME",
                env="LLAMACTOR_SCHEDULER",
                help="policy name, module:Class or path/to/file.py:Class",
            ),
            opt(
                "--scheduler-option",
                field="scheduler_options",
                value="KEY=VALUE",
                parse=values.scheduler_option,
                many=True,
                convert=dict,
                help="an option for the scheduling policy, passed to its constructor (repeatable; "
                "numbers and true/false are converted)",
            ),
            opt(
                "--prefill-budget",
                field="prefill_budget",
                env="LLAMACTOR_PREFILL_BUDGET",
                parse=int,
                help="stall-free, adaptive: a fixed number of prompt tokens per step while streams generate",
            ),
            opt(
                "--target-itl-ms",
                field="target_itl_ms",
                value="MS",
                env="LLAMACTOR_TARGET_ITL_MS",
                parse=float,
                help="stall-free, adaptive: the inter-token target the prompt budget keeps (adaptive: 200)",
            ),
            opt(
                "--target-ttft-ms",
                field="target_ttft_ms",
                value="MS",
                env="LLAMACTOR_TARGET_TTFT_MS",
                parse=float,
                help="adaptive: the first-token target prompts are ordered and hurried by (default 2000)",
            ),
            opt(
                "--slo-ttft-ms",
                field="slo_ttft_ms",
                value="MS",
                env="LLAMACTOR_SLO_TTFT_MS",
                parse=float,
                help="slo: the objective's time to first token, or 4 times what the prompt costs alone on this "
                "machine (as measured) where that is longer (default 2000; 0: that alone)",
            ),
            opt(
                "--slo-itl-ms",
                field="slo_itl_ms",
                value="MS",
                env="LLAMACTOR_SLO_ITL_MS",
                parse=float,
                help="slo: the objective's inter-token gap (default 150; 0: 4 times a token's time for one stream "
                "alone on this machine, as measured)",
            ),
            opt(
                "--slo-itl-pct",
                field="slo_itl_pct",
                value="PCT",
                env="LLAMACTOR_SLO_ITL_PCT",
                parse=values.itl_pct,
                help="slo: the percentile of a request's own gaps held to --slo-itl-ms: p50, p90, p99 or mean "
                "(default p90; mean: the time per output token)",
            ),
            opt(
                "--cohort-max-generate-ms",
                field="cohort_max_generate_ms",
                value="MS",
                env="LLAMACTOR_COHORT_MAX_GENERATE_MS",
                parse=float,
                help="cohort: hand the engine to the next cohort's prefill after this long (0 = drain)",
            ),
            opt("--queue-size", field="queue_size", env="LLAMACTOR_QUEUE_SIZE", parse=int),
            opt(
                "--shutdown-timeout",
                field="shutdown_timeout",
                value="S",
                env="LLAMACTOR_SHUTDOWN_TIMEOUT",
                parse=float,
                help="on SIGTERM: stop admitting (503) and give the requests in flight this long to finish (30)",
            ),
            opt(
                "--replicas",
                field="replicas",
                value="N|MIN:MAX",
                env="LLAMACTOR_REPLICAS",
                help="run N replicas of the engine on Ray Serve, routed by what each has cached, a stream "
                "resumed on another replica if its own dies; MIN:MAX scales with the requests in flight "
                "(needs pip install 'llamactor[cluster]')",
            ),
            opt(
                "--ray-address",
                field="ray_address",
                value="auto|HOST:PORT",
                env="LLAMACTOR_RAY_ADDRESS",
                help="--replicas: join this Ray cluster (started with `ray start`) instead of starting a local one",
            ),
            opt(
                "--replica-router",
                field="replica_router",
                value="cache|prefix-tree|pow2",
                env="LLAMACTOR_REPLICA_ROUTER",
                parse=values.choice("cache", "prefix-tree", "pow2"),
                help="--replicas: route by each replica's real cache (default), by Ray Serve's prefix tree "
                "of routed prompts, or to the less loaded of two random replicas",
            ),
            opt(
                "--prefill-replicas",
                field="prefill_replicas",
                value="N",
                env="LLAMACTOR_PREFILL_REPLICAS",
                parse=int,
                help="--replicas: N replicas prefill prompts and hand each request, with its KV, to one of the "
                "others after its first token; those decode (0: every replica does both)",
            ),
            opt(
                "--replica-pull",
                field="replica_pull",
                value="auto|always|off",
                env="LLAMACTOR_REPLICA_PULL",
                parse=values.choice("auto", "always", "off"),
                help="--replicas: a request routed away from the replica that caches more of its prompt copies "
                "that replica's KV instead of prefilling it: when measured cheaper (auto), always, or never",
            ),
            opt(
                "--replica-cpus",
                field="replica_cpus",
                value="N",
                env="LLAMACTOR_REPLICA_CPUS",
                parse=float,
                help="--replicas: Ray CPUs each replica reserves (placement only; --threads sets what it uses; 1)",
            ),
            switch(
                "--isolate",
                neg=("--no-isolate",),
                field="isolate",
                env="LLAMACTOR_ISOLATE",
                help="run the engine in a child process that is restarted, requests resumed, if it dies",
            ),
            opt(
                "--watchdog-s",
                field="watchdog_s",
                value="S",
                env="LLAMACTOR_WATCHDOG_S",
                parse=float,
                help="--isolate: a decode step running this long ends the engine process (0 = off)",
            ),
            opt(
                "--engine-max-restarts",
                field="engine_max_restarts",
                env="LLAMACTOR_ENGINE_MAX_RESTARTS",
                parse=int,
                help="--isolate: engine restarts allowed within 60 s; past it requests fail and /health stays 503",
            ),
            opt(
                "--resume",
                field="resume",
                value="exact|fast",
                env="LLAMACTOR_RESUME",
                parse=values.choice("exact", "fast"),
                help="--isolate: a resumed request replays its delivered tokens one step at a time (exact: greedy "
                "output unchanged) or prefills them with its prompt (fast: a shorter pause, may diverge)",
            ),
            opt(
                "--resume-max",
                field="resume_max",
                env="LLAMACTOR_RESUME_MAX",
                parse=int,
                help="--isolate, --replicas: times one request may be resumed after engine (replica) deaths",
            ),
            opt(
                "--rpc-fallback",
                field="rpc_fallback",
                value="local",
                env="LLAMACTOR_RPC_FALLBACK",
                parse=values.choice("local"),
                help="--isolate: when a ggml-rpc worker stays away --rpc-wait-s, load the whole model locally",
            ),
            opt(
                "--rpc-wait-s",
                field="rpc_wait_s",
                value="S",
                env="LLAMACTOR_RPC_WAIT_S",
                parse=float,
                help="--rpc-fallback: seconds to wait for a missing worker first (30)",
            ),
            opt(
                "--engine-hooks",
                field="engine_hooks",
                value="MODULE:CLASS",
                env="LLAMACTOR_ENGINE_HOOKS",
                help="--isolate: group hooks made in the engine process (tests, chaos)",
            ),
            switch("--profile", field="profile", env="LLAMACTOR_PIPE_PROF"),
            opt(
                "--record-trace",
                field="record_trace",
                value="FILE",
                env="LLAMACTOR_RECORD_TRACE",
                help="write arrivals and decode-step timings as JSON lines, for `llamactor replay`",
            ),
            opt(
                "--embedding-parallel",
                field="embedding_parallel",
                env="LLAMACTOR_EMBEDDING_PARALLEL",
                parse=int,
                help="inputs packed into one embedding decode",
            ),
        ),
    ),
)


def markdown_table() -> str:
    """The README's "llama-server flags" table, from this module's groups."""
    verdict = {
        Use.CONFIG: "supported",
        Use.SAMPLING: "supported (server default)",
        Use.PROCESS: "supported",
        Use.IGNORE: "accepted, ignored",
        Use.REFUSE: "refused (exit 2)",
    }
    rows = ["| Flags | What llamactor does | Why |", "|---|---|---|"]
    for group in GROUPS:
        if group.title.startswith("llamactor"):
            continue
        flags = ", ".join(f"`{o.names[-1] if o.names[-1].startswith('--') else o.names[0]}`" for o in group.opts)
        rows.append(f"| {group.title}: {flags} | {verdict[group.use]} | {group.why or '—'} |")
    return "\n".join(rows)
