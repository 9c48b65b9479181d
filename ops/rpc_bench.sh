#!/usr/bin/env bash
# Benchmark pipeline groups over a ggml-rpc layer split on one machine.
# Two loopback workers (1 thread each), two servers (N=1 and N=2), local CPU listed last;
# the harness alternates A (N=1) and B (N=2) and prints B/A per sweep point.
#   ops/rpc_bench.sh MODEL.gguf [users sweep, default 16,32,64]
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:?usage: ops/rpc_bench.sh MODEL.gguf [USERS]}
USERS=${2:-16,32,64}
BIN=.venv/bin/llamactor
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT
$BIN worker --port 50071 --threads 1 >/tmp/rpcb-w1.log 2>&1 & pids+=($!)
$BIN worker --port 50072 --threads 1 >/tmp/rpcb-w2.log 2>&1 & pids+=($!)
sleep 2
common=(-m "$MODEL" -np 64 -c 32768 -b 2048 -ub 512 -t 1 --device RPC0,CPU --tensor-split 1,1 -sm layer --profile)
$BIN serve "${common[@]}" --rpc 127.0.0.1:50071 --port 8181 --pipeline-groups 1 >/tmp/rpcb-n1.log 2>&1 & pids+=($!)
$BIN serve "${common[@]}" --rpc 127.0.0.1:50072 --port 8182 --pipeline-groups 2 >/tmp/rpcb-n2.log 2>&1 & pids+=($!)
for port in 8181 8182; do
  for _ in $(seq 120); do curl -sf "127.0.0.1:$port/health" >/dev/null && break; sleep 0.5; done
done
$BIN bench --url http://127.0.0.1:8181 --vs http://127.0.0.1:8182 --sweep "users=$USERS" \
     --requests 1 --npp 128 --ntg 64 --pairs 1 "${@:3}"
echo "--- per-group profile, N=2 (last line per group):"
grep pipe_profile /tmp/rpcb-n2.log | tail -2
