#!/usr/bin/env bash
# Check of the replay model (``llamactor replay``): serve with --record-trace, run one `llamactor bench`
# against it, stop the server, replay the trace with the policy that served it, and compare the
# predicted TTFT p50 and inter-token p99 with what the benchmark measured (the bar: within 15 %).
#
#   ops/replay_check.sh MODEL [serve flags ...] [-- bench flags ...]
#   e.g. ops/replay_check.sh "$MODEL" -np 32 -c 65536 -b 512 -t 2 -- --workload burst
#
# The benchmark runs with --warmup 0 (warm-up requests would be in the trace but not in the
# measured figures; pass --warmup N after -- to override). One run only (no --vs/--sweep/--pairs).
# Environment: PORT (default 8093), OUT (folder for serve.log, trace.jsonl, bench.json,
# replay.json; default a new /tmp/replay_check.*), LLAMACTOR, PYTHON (default: the .venv's).
# Exit status: 0 both within 15 %, 1 otherwise or if a step failed, 2 usage.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $# -lt 1 || $1 == -* ]]; then
    sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
MODEL=$1
shift
SERVE=()
while [[ $# -gt 0 && $1 != -- ]]; do SERVE+=("$1"); shift; done
[[ $# -gt 0 ]] && shift
BENCH=("$@")
PORT=${PORT:-8093}
OUT=${OUT:-$(mktemp -d /tmp/replay_check.XXXXXX)}
LLAMACTOR=${LLAMACTOR:-.venv/bin/llamactor}
PYTHON=${PYTHON:-.venv/bin/python}
URL=http://127.0.0.1:$PORT
mkdir -p "$OUT"

echo "replay check: serving $MODEL on $URL, files in $OUT" >&2
"$LLAMACTOR" serve -m "$MODEL" --port "$PORT" --record-trace "$OUT/trace.jsonl" "${SERVE[@]}" 2>"$OUT/serve.log" &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true' EXIT

"$PYTHON" - "$URL" "$SERVER" <<'EOF'
import os, sys, time
import httpx
url, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 600
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("replay check: the server exited (see serve.log)")
    try:
        if httpx.get(url + "/health", timeout=2).status_code == 200:
            sys.exit(0)
    except httpx.TransportError:
        pass
    time.sleep(0.2)
sys.exit("replay check: the server did not become ready in 600 s")
EOF

status=0
"$LLAMACTOR" bench --url "$URL" --warmup 0 --json "${BENCH[@]}" >"$OUT/bench.json" || status=$?
kill -TERM "$SERVER"
wait "$SERVER" || true  # the trace's last records are written at shutdown
trap - EXIT
if [[ $status -ne 0 ]]; then
    echo "replay check: llamactor bench exited with status $status (see $OUT/bench.json)" >&2
    [[ -s "$OUT/bench.json" ]] || exit 1
fi
"$LLAMACTOR" replay "$OUT/trace.jsonl" --json >"$OUT/replay.json"

"$PYTHON" - "$OUT/bench.json" "$OUT/replay.json" <<'EOF'
import json, sys
TOLERANCE = 0.15
bench, replay = (json.load(open(p)) for p in sys.argv[1:3])
measured = bench["runs"][0]["figures"]
policy = replay["policies"][0]
predicted = policy["figures"]
fit = replay["fit"]
print(f"trace: {replay['requests']} requests, {replay['steps']} steps, replayed with --scheduler {policy['scheduler']}")
print(f"decode fit: {fit['decode']['formula']} ms, R^2 = {fit['decode']['r2']}")
print(f"loop fit:   {fit['loop']['formula']} ms, R^2 = {fit['loop']['r2']}")
print(f"{'figure':<20} {'measured':>10} {'predicted':>10} {'error':>8}")
ok = True
for label, key, judged in (("TTFT p50 ms", "ttft_p50_ms", True), ("inter-token p99 ms", "itl_p99_ms", True),
                           ("TTFT mean ms", "ttft_mean_ms", False), ("makespan s", "makespan_s", False)):
    m = measured.get(key)
    if m is None and key == "itl_p99_ms":
        m = measured.get("gap_p99_ms")
    p = predicted.get(key)
    if m is None or p is None or m == 0:
        print(f"{label:<20} {m!s:>10} {p!s:>10} {'-':>8}")
        ok = ok and not judged
        continue
    err = (p - m) / m
    mark = ("ok" if abs(err) <= TOLERANCE else "OVER 15 %") if judged else ""
    print(f"{label:<20} {m:>10.1f} {p:>10.1f} {err:>+8.1%} {mark}")
    ok = ok and (abs(err) <= TOLERANCE or not judged)
server = replay["recorded"]["figures"].get("ttft_p50_ms")
if server is not None:
    print(f"(TTFT p50 as the server recorded it, without HTTP: {server:.1f} ms)")
sys.exit(0 if ok else 1)
EOF
