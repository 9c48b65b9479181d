"""Prometheus metrics of one runtime: llama-server's ``llamacpp:*`` names plus
TTFT, inter-token and queue-time histograms, every series labelled by ``group``.

Counters live in plain per-group ``GroupCounters`` objects bumped once per decode step by the
group that decoded (so nothing is counted twice), and are read at scrape time by a custom
collector: the hot path pays a few integer additions per step, not a Prometheus call per token.
Each runtime has its own registry: no global state, two runtimes can coexist.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from llamactor.actors.observe import GroupCounters

if TYPE_CHECKING:
    from llamactor.runtime.engine.context import StepResult
    from llamactor.runtime.engine.promptcache import PromptCacheStats

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
GAP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)


class Metrics:
    def __init__(self, n_groups: int, queue_depth: Callable[[], int] = lambda: 0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.groups = [GroupCounters() for _ in range(n_groups)]
        self.queue_depth = queue_depth
        self.phase_of: Callable[[int], str] = lambda g: "none"
        self.waiting_of: Callable[[int], int] = lambda g: 0
        self.restarts_of: Callable[[int], int] = lambda g: 0
        self.down_of: Callable[[int], bool] = lambda g: False
        self.prompt_cache: Callable[[], PromptCacheStats] | None = None  # host-memory prompt cache statistics, when on
        self._ttft = Histogram(
            "llamactor:time_to_first_token_seconds",
            "Time from arrival to the first token",
            ["group"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self._gap = Histogram(
            "llamactor:inter_token_seconds",
            "Gap between consecutive tokens of one stream",
            ["group"],
            buckets=GAP_BUCKETS_S,
            registry=self.registry,
        )
        self._queue = Histogram(
            "llamactor:queue_seconds",
            "Time from arrival to slot assignment",
            ["group"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self._cohort_size = Histogram(
            "llamactor:cohort_size",
            "Members of a prefill cohort when it was released to generation",
            ["group"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=self.registry,
        )
        self._barrier = Histogram(
            "llamactor:barrier_wait_seconds",
            "From a cohort's seal to its release to generation",
            ["group"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self._ttft_g = [self._ttft.labels(str(g)) for g in range(n_groups)]
        self._gap_g = [self._gap.labels(str(g)) for g in range(n_groups)]
        self._queue_g = [self._queue.labels(str(g)) for g in range(n_groups)]
        self.registry.register(_CounterCollector(self))

    # ---- called by groups ----------------------------------------------------------------

    def step(self, group: int, res: StepResult) -> None:
        """Once per decode step of ``group``."""
        c = self.groups[group]
        c.n_decode += 1
        c.n_busy_slots += res.n_rows
        c.prompt_tokens += res.n_prompt
        c.tokens_predicted += res.n_generated
        if res.accepted:  # speculative decoding: only steps that verified drafts
            c.n_draft_tokens += res.n_draft
            c.n_drafts += len(res.accepted)
            by = c.drafts_by_accepted
            for a in res.accepted:
                c.n_draft_accepted += a
                if a >= len(by):
                    by.extend([0] * (a + 1 - len(by)))
                by[a] += 1
        gap = self._gap_g[group]
        for g in res.gaps:
            gap.observe(g)

    def request_done(self, group: int, prompt_s: float, predicted_s: float, n_tokens: int) -> None:
        c = self.groups[group]
        c.prompt_seconds += prompt_s
        c.predicted_seconds += predicted_s
        c.tokens_max = max(c.tokens_max, n_tokens)

    def ttft(self, group: int, seconds: float) -> None:
        self._ttft_g[group].observe(seconds)

    def queue_time(self, group: int, seconds: float) -> None:
        self._queue_g[group].observe(seconds)

    def cohort_released(self, group: int, size: int, barrier_wait_s: float) -> None:
        self._cohort_size.labels(str(group)).observe(size)
        self._barrier.labels(str(group)).observe(barrier_wait_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _CounterCollector:
    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def describe(self):
        return []

    def collect(self):
        gs = self.m.groups
        labels = ["group"]

        def counter(name: str, doc: str, value: Callable[[GroupCounters], float]) -> CounterMetricFamily:
            fam = CounterMetricFamily(f"llamacpp:{name}", doc, labels=labels)
            for g, c in enumerate(gs):
                fam.add_metric([str(g)], value(c))
            return fam

        def gauge(name: str, doc: str, value: Callable[[GroupCounters], float]) -> GaugeMetricFamily:
            fam = GaugeMetricFamily(f"llamacpp:{name}", doc, labels=labels)
            for g, c in enumerate(gs):
                fam.add_metric([str(g)], value(c))
            return fam

        yield counter("prompt_tokens", "Number of prompt tokens processed", lambda c: c.prompt_tokens)
        yield counter("prompt_seconds", "Total time spent processing prompts", lambda c: c.prompt_seconds)
        yield counter("tokens_predicted", "Number of generation tokens processed", lambda c: c.tokens_predicted)
        yield counter("tokens_predicted_seconds", "Total time spent generating tokens", lambda c: c.predicted_seconds)
        yield counter("n_decode", "Total number of llama_decode() calls", lambda c: c.n_decode)
        yield gauge("n_tokens_max", "Largest observed sequence length", lambda c: c.tokens_max)
        yield gauge(
            "prompt_tokens_seconds",
            "Average prompt throughput in tokens/s",
            lambda c: c.prompt_tokens / c.prompt_seconds if c.prompt_seconds else 0.0,
        )
        yield gauge(
            "predicted_tokens_seconds",
            "Average generation throughput in tokens/s",
            lambda c: c.tokens_predicted / c.predicted_seconds if c.predicted_seconds else 0.0,
        )
        yield gauge("requests_processing", "Number of requests processing", lambda c: c.requests_processing)
        yield gauge(
            "n_busy_slots_per_decode",
            "Average number of busy slots per llama_decode() call",
            lambda c: c.n_busy_slots / max(c.n_decode, 1),
        )
        yield counter(
            "spec_decode_num_draft_tokens", "Speculative: Total draft tokens generated", lambda c: c.n_draft_tokens
        )
        yield counter(
            "spec_decode_num_accepted_tokens",
            "Speculative: Total draft tokens accepted by the target model",
            lambda c: c.n_draft_accepted,
        )
        yield counter(
            "spec_decode_num_drafts", "Speculative: Total speculative decoding verification steps", lambda c: c.n_drafts
        )
        per_pos = CounterMetricFamily(
            "llamacpp:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position",
            labels=["group", "position"],
        )
        for g, c in enumerate(gs):
            for pos, value in enumerate(c.accepted_per_pos()):
                per_pos.add_metric([str(g), str(pos)], value)
        yield per_pos
        deferred = GaugeMetricFamily("llamacpp:requests_deferred", "Number of requests deferred")
        deferred.add_metric([], self.m.queue_depth())
        yield deferred
        phase = GaugeMetricFamily(
            "llamactor:group_phase", "Current phase per group (1 = in this phase)", labels=["group", "phase"]
        )
        for g in range(len(gs)):
            phase.add_metric([str(g), self.m.phase_of(g)], 1)
        yield phase
        waiting = GaugeMetricFamily(
            "llamactor:requests_waiting_for_phase",
            "Requests holding a slot that wait for a phase grant",
            labels=["group"],
        )
        for g in range(len(gs)):
            waiting.add_metric([str(g)], self.m.waiting_of(g))
        yield waiting
        restarts = CounterMetricFamily(
            "llamactor:group_restarts", "Restarts of a group after its decode loop failed", labels=["group"]
        )
        down = GaugeMetricFamily(
            "llamactor:group_down", "1 when the group is down past its restart limit", labels=["group"]
        )
        failed = CounterMetricFamily(
            "llamactor:requests_failed", "Requests that failed alone while the group went on", labels=["group"]
        )
        for g, c in enumerate(gs):
            restarts.add_metric([str(g)], self.m.restarts_of(g))
            down.add_metric([str(g)], 1 if self.m.down_of(g) else 0)
            failed.add_metric([str(g)], c.requests_failed)
        yield restarts
        yield down
        yield failed
        for name, doc, value in (
            (
                "prefix_shares",
                "Prompts that copied a common prefix from another slot's KV",
                lambda c: c.prefix_shares,
            ),
            (
                "prefix_tokens_shared",
                "Prompt tokens copied from another slot's KV instead of prefilled",
                lambda c: c.prefix_tokens_shared,
            ),
        ):
            fam = CounterMetricFamily(f"llamactor:{name}", doc, labels=["group"])
            for g, c in enumerate(gs):
                fam.add_metric([str(g)], value(c))
            yield fam
        if self.m.prompt_cache is not None:
            stats = self.m.prompt_cache()
            for name, doc, value, kind in (
                ("prompt_cache_hits", "Prompts restored from the host-memory prompt cache", stats.hits, "counter"),
                (
                    "prompt_cache_tokens_reused",
                    "Prompt tokens restored instead of prefilled",
                    stats.tokens_reused,
                    "counter",
                ),
                ("prompt_cache_saves", "Slot states saved to the host-memory prompt cache", stats.saves, "counter"),
                ("prompt_cache_bytes", "Bytes held by the host-memory prompt cache", stats.bytes_held, "gauge"),
                ("prompt_cache_entries", "Prompts held by the host-memory prompt cache", stats.entries, "gauge"),
            ):
                fam = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(f"llamactor:{name}", doc)
                fam.add_metric([], value)
                yield fam
