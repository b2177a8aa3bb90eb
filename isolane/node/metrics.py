"""``GET /metrics``: a node's counters in the Prometheus text format.

Each node has a ``CollectorRegistry`` of its own (tests run several nodes in one
process; nothing goes into prometheus-client's global registry). Request counts and
latencies are recorded by the app's middleware; lanes, devices, KV pools and load are
read from the node when scraped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from isolane.node.resources import Node

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0, 10.0, 30.0, 120.0)


class NodeMetrics:
    def __init__(self, node: Node) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter("isolane_http_requests", "HTTP requests answered",
                                ["method", "route", "status"], registry=self.registry)
        self.latency = Histogram("isolane_http_request_seconds",
                                 "Time from request to the end of its response",
                                 ["route"], buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.registry.register(_NodeCollector(node))

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests.labels(method, route, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _NodeCollector(Collector):
    def __init__(self, node: Node) -> None:
        self.node = node

    def collect(self) -> Iterator[Metric]:
        node = self.node
        stats = node.stats()
        inflight = stats["inflight"]
        yield GaugeMetricFamily("isolane_inflight_requests", "Requests being handled",
                                value=inflight["requests"])
        yield GaugeMetricFamily("isolane_inflight_bytes",
                                "Bytes held by handlers (received not yet stored, or read "
                                "not yet sent)", value=inflight["bytes"])
        yield CounterMetricFamily("isolane_received_bytes", "Body bytes received",
                                  value=stats["totals"]["bytes_in"])
        yield CounterMetricFamily("isolane_sent_bytes", "Body bytes sent",
                                  value=stats["totals"]["bytes_out"])
        yield CounterMetricFamily("isolane_snapshot_plans", "Snapshot upload plans made",
                                  value=stats["snapshots"]["plans"])
        yield CounterMetricFamily("isolane_snapshot_plans_reused",
                                  "Snapshot uploads that followed their plan request's plan",
                                  value=stats["snapshots"]["plans_reused"])
        latency = GaugeMetricFamily("isolane_lane_latency_seconds",
                                    "Lane job latency percentiles over the recent window",
                                    labels=["lane", "quantile"])
        queue = GaugeMetricFamily("isolane_lane_queue_depth", "Jobs waiting in a lane",
                                  labels=["lane"])
        for lane, values in stats["lanes"].items():
            for name, q in (("p50", "0.5"), ("p99", "0.99"), ("p999", "0.999")):
                if values.get(name) is not None:
                    latency.add_metric([lane, q], values[name] / 1e3)
            if isinstance(values.get("queue_depth"), int):
                queue.add_metric([lane], values["queue_depth"])
        yield latency
        yield queue
        yield from _host_metrics(stats.get("host") or {})
        free = GaugeMetricFamily("isolane_device_free_bytes", "Free bytes of a local device",
                                 labels=["role", "device"])
        for role, group in stats["capacity"].items():
            for device in group["devices"]:
                if device["free_bytes"] is not None:
                    free.add_metric([role, device["device"]], device["free_bytes"])
        yield free
        blocks = GaugeMetricFamily("isolane_kv_blocks", "KV blocks stored, per tier",
                                   labels=["namespace", "tier"])
        stored = GaugeMetricFamily("isolane_kv_bytes", "KV bytes stored, per tier",
                                   labels=["namespace", "tier"])
        hits = CounterMetricFamily("isolane_kv_memory_hits", "KV memory tier hits",
                                   labels=["namespace"])
        misses = CounterMetricFamily("isolane_kv_memory_misses", "KV memory tier misses",
                                     labels=["namespace"])
        for name, pool in node.kv.open_pools().items():
            pool_stats = pool.stats()
            memory = pool_stats["memory"]
            blocks.add_metric([name, "memory"], memory["blocks"])
            stored.add_metric([name, "memory"], memory["bytes"])
            blocks.add_metric([name, "disk"], sum(d["blocks"] for d in pool_stats["disk"]))
            stored.add_metric([name, "disk"], sum(d["bytes"] for d in pool_stats["disk"]))
            if pool_stats["capacity"] is not None:
                blocks.add_metric([name, "capacity"], pool_stats["capacity"]["blocks"])
                stored.add_metric([name, "capacity"], pool_stats["capacity"]["bytes"])
            hits.add_metric([name], memory["hits"])
            misses.add_metric([name], memory["misses"])
        yield from (blocks, stored, hits, misses)


def _host_metrics(host: dict[str, Any]) -> Iterator[Metric]:
    """The host lane plane: every process on this host config, not just this node."""
    if not host.get("available"):
        return
    members = host["members"]
    yield GaugeMetricFamily("isolane_host_members", "Processes in the host lane plane",
                            value=len(members))
    latency = GaugeMetricFamily("isolane_host_read_latency_seconds",
                                "KV get latency percentiles of all the host's processes",
                                labels=["quantile"])
    for name, q in (("p50", "0.5"), ("p99", "0.99"), ("p999", "0.999")):
        value = host["read_latency_ms"].get(name)
        if value is not None:
            latency.add_metric([q], value / 1e3)
    yield latency
    rate = GaugeMetricFamily("isolane_host_write_rate_bytes_per_second",
                             "The host governor's checkpoint write rate (absent: unlimited)")
    if host.get("write_rate_bytes_per_s") is not None:
        rate.add_metric([], host["write_rate_bytes_per_s"])
    yield rate
    writing = GaugeMetricFamily("isolane_host_member_write_bytes_per_second",
                                "Checkpoint bytes a second written by each host process",
                                labels=["pid", "roles"])
    for member in members:
        writing.add_metric([str(member["pid"]), ",".join(member["roles"])],
                           member["write_bytes_per_s"])
    yield writing
