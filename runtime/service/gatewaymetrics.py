"""The inference gateway's series of one runtime, and the reading they are made from.

They are the Kubernetes Gateway API Inference Extension's model server protocol, named as vLLM
names them with ``llamactor:`` for ``vllm:``, so that an endpoint picker (llm-d's inference
scheduler, the GIE EPP) scrapes llamactor as it scrapes vLLM: one unlabelled series each, totals
over the groups, read from a ``ServingLoad`` made at the scrape (docs/server.md, "Behind an
inference gateway"). ``runtime.service.metrics.Metrics`` registers the collector in its registry.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily

# The block the gateway series count KV cells in (``llamactor:cache_config_info``). llamactor has
# no paged blocks: a prompt reuses any common prefix token by token. 16 tokens is vLLM's default
# block and the endpoint picker's default prefix block, so its prefix index needs no retuning.
GATEWAY_BLOCK_TOKENS = 16


@dataclass(frozen=True)
class ServingLoad:
    """What the gateway series read at a scrape, taken from the supervisor and its groups."""

    queued: int = 0  # requests waiting for a slot (the supervisor's queue)
    running: int = 0  # requests holding slots
    kv_cells_used: int = 0  # KV cells the slots serving a request hold (all groups)
    running_lora: tuple[int, ...] = ()  # adapter ids the running requests apply, ascending
    waiting_lora: tuple[int, ...] = ()  # adapter ids the queued requests will apply, ascending


def adapter_names(paths: Iterable[str | PathLike[str]]) -> tuple[str, ...]:
    """Each LoRA adapter's name in ``llamactor:lora_requests_info``, by id: its file name without
    ``.gguf`` (commas, the list separator, become ``_``); a name taken already gets ``-ID``."""
    names: list[str] = []
    for i, path in enumerate(paths):
        name = Path(path).name.removesuffix(".gguf").replace(",", "_") or f"lora-{i}"
        names.append(f"{name}-{i}" if name in names else name)
    return tuple(names)


class GatewayReading(Protocol):
    """What the collector reads at each scrape (``Metrics`` has these; ``load`` is set by the engine)."""

    load: Callable[[], ServingLoad]
    kv_cells_total: int  # KV cells of every group's context together
    lora_names: tuple[str, ...]  # per adapter id, its name in the LoRA series


class GatewayCollector:
    """The model server protocol's series (module docstring); each scrape reads one
    ``ServingLoad``, a pass over the slots: nothing is kept up to date between scrapes."""

    def __init__(self, metrics: GatewayReading) -> None:
        self.m = metrics
        # the LoRA labels as last scraped (at the start: nothing running or waiting), and the unix
        # time a scrape found them changed: the series' value, so the newest series is the largest
        self._lora_labels = ("", "", str(len(metrics.lora_names)))
        self._lora_changed = time.time()

    def describe(self):
        return []

    def collect(self):
        m = self.m
        load = m.load()
        total = m.kv_cells_total

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"llamactor:{name}", doc, value=value)

        yield gauge("num_requests_waiting", "Requests waiting for a slot (queued)", load.queued)
        yield gauge("num_requests_running", "Requests holding a slot (being served)", load.running)
        yield gauge(
            "kv_cache_usage_perc",
            "KV cache usage as a fraction, 1 = full: cells held by the slots serving a request over "
            "every group's KV cells",
            min(load.kv_cells_used / total, 1.0) if total > 0 else 0.0,
        )
        info = GaugeMetricFamily(
            "llamactor:cache_config_info",
            "KV cache sizes for the gateway, in blocks of block_size tokens (llamactor has no paged blocks)",
            labels=["block_size", "num_gpu_blocks"],
        )
        info.add_metric([str(GATEWAY_BLOCK_TOKENS), str(total // GATEWAY_BLOCK_TOKENS)], 1.0)
        yield info
        names = m.lora_names
        labels = (
            ",".join(names[i] for i in load.running_lora if i < len(names)),
            ",".join(names[i] for i in load.waiting_lora if i < len(names)),
            str(len(names)),
        )
        if labels != self._lora_labels:
            self._lora_labels, self._lora_changed = labels, time.time()
        lora = GaugeMetricFamily(
            "llamactor:lora_requests_info",
            "LoRA adapters of running and waiting requests; the value is the unix time they last changed",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        lora.add_metric(list(labels), self._lora_changed)
        yield lora


__all__ = ["GATEWAY_BLOCK_TOKENS", "GatewayCollector", "GatewayReading", "ServingLoad", "adapter_names"]
