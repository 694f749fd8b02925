"""`GET /metrics`: what the server is doing, in Prometheus text, through prometheus-client.

Requests by endpoint and status (and by replica), prompt and generated tokens, time to first token and
time per output token (histograms), requests waiting for a slot, requests in the batch
(per replica), HTTP connections held and shed past the cap, and the bytes each rank has
sent on each link, asked of the ranks at
scrape time (`smol_link_sent_bytes_total{replica, src, dst}`). One registry per server,
so several servers in one process (tests) do not mix their figures.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


def endpoint(path: str) -> str:
    """The metrics label of a request's path (`other` for the rest: scanners must not grow the label set)."""
    p = path.split("?")[0]
    return p if p in ENDPOINTS else "other"


class _Links:
    """Bytes sent per link, from each replica's ranks when scraped."""

    def __init__(self, router, names: list[list[str]]):
        self.router, self.names = router, names

    def collect(self):
        fam = CounterMetricFamily(
            "smol_link_sent_bytes", "payload bytes each rank sent on each link", labels=["replica", "src", "dst"]
        )
        for rep, ranks in enumerate(self.router.stats()):
            for r, st in enumerate(ranks or []):
                for dst, n in st["links"]:
                    names = self.names[rep]
                    fam.add_metric([str(rep), names[r], names[int(dst)]], float(n))
        yield fam


class Metrics:
    def __init__(self, router, names: list[list[str]]):
        reg = self.registry = CollectorRegistry()
        self.requests = Counter(
            "smol_requests", "HTTP requests answered, by endpoint and status", ["endpoint", "status"], registry=reg
        )
        self.prompt_tokens = Counter("smol_prompt_tokens", "prompt tokens of the requests served", registry=reg)
        self.tokens = Counter("smol_generated_tokens", "tokens generated", registry=reg)
        self.ttft = Histogram(
            "smol_time_to_first_token_seconds", "from request to first token", buckets=TTFT_BUCKETS, registry=reg
        )
        self.tpot = Histogram(
            "smol_time_per_output_token_seconds", "between a request's tokens", buckets=TPOT_BUCKETS, registry=reg
        )
        self.queue = Gauge("smol_queue_depth", "requests waiting for a slot", registry=reg)
        self.batch = Gauge("smol_batch_size", "requests in the batch, decoding", ["replica"], registry=reg)
        self.routed = Counter("smol_replica_requests", "requests sent to each replica", ["replica"], registry=reg)
        self.connections = Gauge("smol_http_connections", "HTTP connections held", registry=reg)
        self.shed = Gauge("smol_http_shed_connections", "connections refused or evicted past the cap", registry=reg)
        for i in range(len(names)):
            self.batch.labels(str(i)).set(0)
            self.routed.labels(str(i))
        reg.register(_Links(router, names))

    def render(self) -> bytes:
        return generate_latest(self.registry)
