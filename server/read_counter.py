"""A Prometheus counter read from the engine at each scrape, for counts the engine keeps itself (prometheus_client's
Counter is incremented, not read, and a Gauge would lose rate()'s reset handling)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector


class ReadCounter(Collector):
    def __init__(self, name: str, documentation: str, model_name: str, read: Callable[[], float],
                 registry: CollectorRegistry) -> None:
        self.name, self.documentation, self.model_name, self.read = name, documentation, model_name, read
        registry.register(self)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=["model_name"])
        family.add_metric([self.model_name], float(self.read()))
        yield family
