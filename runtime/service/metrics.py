"""Prometheus metrics of one runtime: llama-server's ``llamacpp:*`` series as llama-server
writes them (unlabelled totals), the same per group as ``llamactor:group_*{group=...}``, and
TTFT, inter-token and queue-time histograms labelled by ``group``.

Counters live in plain per-group ``GroupCounters`` objects bumped once per decode step by the
group that decoded (so nothing is counted twice), and are read at scrape time by a custom
collector: the hot path pays a few integer additions per step, not a Prometheus call per token.
Each runtime has its own registry: no global state, two runtimes can coexist.

The inference gateway's series (vLLM's names, for an endpoint picker) are
``runtime.service.gatewaymetrics``, registered here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.utils import floatToGoString

from llamactor.actors.observe import GroupCounters
from llamactor.runtime.service.gatewaymetrics import GatewayCollector, ServingLoad

if TYPE_CHECKING:
    from llamactor.runtime.engine.context import StepResult
    from llamactor.runtime.engine.promptcache import PromptCacheStats


LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
GAP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)


class Metrics:
    def __init__(
        self,
        n_groups: int,
        queue_depth: Callable[[], int] = lambda: 0,
        *,
        kv_cells_total: int = 0,
        lora_names: tuple[str, ...] = (),
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.groups = [GroupCounters() for _ in range(n_groups)]
        self.queue_depth = queue_depth
        self.phase_of: Callable[[int], str] = lambda g: "none"
        self.waiting_of: Callable[[int], int] = lambda g: 0
        self.restarts_of: Callable[[int], int] = lambda g: 0
        self.down_of: Callable[[int], bool] = lambda g: False
        self.prompt_cache: Callable[[], PromptCacheStats] | None = None  # host-memory prompt cache statistics, when on
        self.load: Callable[[], ServingLoad] = ServingLoad  # the gateway series' reading (set by the engine)
        # the embedding context's (prompt tokens decoded, decodes), counted in llama-server's totals
        self.embedding_work: Callable[[], tuple[int, int]] = lambda: (0, 0)
        self.kv_cells_total = kv_cells_total  # KV cells of every group's context together
        self.lora_names = lora_names  # per adapter id, its name in the gateway's LoRA series
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
        self.registry.register(GatewayCollector(self))

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
        """llama-server's ``llamacpp:*`` block, then llamactor's own series."""
        return self.llamacpp_text().encode() + generate_latest(self.registry)

    def llamacpp_text(self) -> str:
        """llama-server's series exactly as it writes them (``to_metrics``): one unlabelled sample
        each, the totals over the groups, every name spelled in full on its ``# TYPE`` line (also
        ``n_tokens_max``, a counter without ``_total`` there), then the per-position acceptances."""
        gs = self.groups

        def total(value: Callable[[GroupCounters], float]) -> float:
            return sum(value(c) for c in gs)

        prompt_s, predicted_s = total(lambda c: c.prompt_seconds), total(lambda c: c.predicted_seconds)
        embedded, embedding_decodes = self.embedding_work()
        n_prompt = total(lambda c: c.prompt_tokens) + embedded
        n_decode = total(lambda c: c.n_decode) + embedding_decodes
        counters = (
            ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", n_prompt),
            (
                "prompt_tokens_cached_total",
                "Number of prompt tokens reused from the cache",
                total(lambda c: c.prompt_cached),
            ),
            ("prompt_seconds_total", "Total time spent processing prompts", prompt_s),
            ("tokens_predicted_total", "Number of generation tokens processed", total(lambda c: c.tokens_predicted)),
            ("tokens_predicted_seconds_total", "Total time spent generating tokens", predicted_s),
            ("n_decode_total", "Total number of llama_decode() calls, excluding speculative decoding", n_decode),
            (
                "n_tokens_max",
                "Largest observed sequence length (prompt + generation)",
                max((c.tokens_max for c in gs), default=0),
            ),
            (
                "spec_decode_num_draft_tokens_total",
                "Speculative: Total draft tokens generated",
                total(lambda c: c.n_draft_tokens),
            ),
            (
                "spec_decode_num_accepted_tokens_total",
                "Speculative: Total draft tokens accepted by the target model",
                total(lambda c: c.n_draft_accepted),
            ),
            (
                "spec_decode_num_drafts_total",
                "Speculative: Total speculative decoding verification steps",
                total(lambda c: c.n_drafts),
            ),
        )
        gauges = (
            (
                "prompt_tokens_seconds",
                "Average prompt throughput in tokens/s",
                n_prompt / prompt_s if prompt_s else 0.0,
            ),
            (
                "predicted_tokens_seconds",
                "Average generation throughput in tokens/s",
                total(lambda c: c.tokens_predicted) / predicted_s if predicted_s else 0.0,
            ),
            ("requests_processing", "Number of requests processing", total(lambda c: c.requests_processing)),
            ("requests_deferred", "Number of requests deferred", self.queue_depth()),
            (
                "n_busy_slots_per_decode",
                "Average number of busy slots per llama_decode() call",
                total(lambda c: c.n_busy_slots) / max(n_decode, 1),
            ),
        )
        lines: list[str] = []
        for kind, items in (("counter", counters), ("gauge", gauges)):
            for name, doc, value in items:
                lines += (
                    f"# HELP llamacpp:{name} {doc}",
                    f"# TYPE llamacpp:{name} {kind}",
                    f"llamacpp:{name} {floatToGoString(value)}",
                )
        per_pos = [0] * max((len(c.accepted_per_pos()) for c in gs), default=0)
        for c in gs:
            for pos, value in enumerate(c.accepted_per_pos()):
                per_pos[pos] += value
        if per_pos:
            name = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total"
            lines += (f"# HELP {name} Accepted tokens per draft position", f"# TYPE {name} counter")
            lines += (f'{name}{{position="{pos}"}} {value}' for pos, value in enumerate(per_pos))
        return "\n".join(lines) + "\n"


# llamactor's per-group view of llama-server's series: (name, kind, help, value of one group)
_GROUP_SERIES: tuple[tuple[str, str, str, Callable[[GroupCounters], float]], ...] = (
    ("prompt_tokens", "counter", "Prompt tokens processed, cached ones excluded", lambda c: c.prompt_tokens),
    ("prompt_tokens_cached", "counter", "Prompt tokens reused from the cache", lambda c: c.prompt_cached),
    ("prompt_seconds", "counter", "Time spent processing prompts", lambda c: c.prompt_seconds),
    ("tokens_predicted", "counter", "Generation tokens processed", lambda c: c.tokens_predicted),
    ("tokens_predicted_seconds", "counter", "Time spent generating tokens", lambda c: c.predicted_seconds),
    ("n_decode", "counter", "llama_decode() calls", lambda c: c.n_decode),
    ("n_tokens_max", "gauge", "Largest observed sequence length", lambda c: c.tokens_max),
    ("requests_processing", "gauge", "Requests processing", lambda c: c.requests_processing),
    (
        "n_busy_slots_per_decode",
        "gauge",
        "Average busy slots per llama_decode() call",
        lambda c: c.n_busy_slots / max(c.n_decode, 1),
    ),
    ("spec_decode_num_draft_tokens", "counter", "Speculative: draft tokens generated", lambda c: c.n_draft_tokens),
    (
        "spec_decode_num_accepted_tokens",
        "counter",
        "Speculative: draft tokens accepted by the target model",
        lambda c: c.n_draft_accepted,
    ),
    ("spec_decode_num_drafts", "counter", "Speculative: verification steps", lambda c: c.n_drafts),
)


class _CounterCollector:
    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def describe(self):
        return []

    def collect(self):
        gs = self.m.groups
        for name, kind, doc, value in _GROUP_SERIES:
            fam = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                f"llamactor:group_{name}", f"{doc}, per group", labels=["group"]
            )
            for g, c in enumerate(gs):
                fam.add_metric([str(g)], value(c))
            yield fam
        per_pos = CounterMetricFamily(
            "llamactor:group_spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position, per group",
            labels=["group", "position"],
        )
        for g, c in enumerate(gs):
            for pos, value in enumerate(c.accepted_per_pos()):
                per_pos.add_metric([str(g), str(pos)], value)
        yield per_pos
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
