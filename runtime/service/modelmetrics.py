"""One Prometheus exposition of many models (the router mode's ``GET /metrics``).

Each model's runtime renders its own text (llama-server's ``llamacpp:*`` series and llamactor's,
labelled by ``group``). Here those texts are read back, every sample gets a ``model`` label, and
the samples of one family from every model go under one ``# HELP``/``# TYPE`` pair, as the
exposition format wants (a family described twice is an error to a Prometheus scraper).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

MODEL_LABEL = "model"


class _Families:
    """A collector that yields the families it was made with (read once, at the scrape)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def labelled(texts: Iterable[tuple[str, bytes]], own: Iterable[Metric] = ()) -> bytes:
    """``texts`` (model name, its exposition text) as one text, every sample labelled with its
    model, followed by ``own`` families (already labelled)."""
    families: dict[str, Metric] = {}
    for model, text in texts:
        for family in text_string_to_metric_families(text.decode("utf-8", "replace")):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                merged.samples.append(sample._replace(labels={MODEL_LABEL: model, **sample.labels}))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([*families.values(), *own]))
    return generate_latest(registry)


def gauge(name: str, documentation: str, values: Mapping[str, float]) -> GaugeMetricFamily:
    """A gauge with one sample per model."""
    family = GaugeMetricFamily(name, documentation, labels=[MODEL_LABEL])
    for model, value in values.items():
        family.add_metric([model], value)
    return family


def counter(name: str, documentation: str, values: Mapping[str, float]) -> CounterMetricFamily:
    """A counter (``name`` without ``_total``) with one sample per model."""
    family = CounterMetricFamily(name, documentation, labels=[MODEL_LABEL])
    for model, value in values.items():
        family.add_metric([model], value)
    return family
