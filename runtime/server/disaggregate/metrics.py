"""The router's Prometheus metrics: the server's own (ServerMetrics), the KV transfers between
engines, and each engine's liveness, KV blocks and requests as it last reported them."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from llmc.runtime.server.disaggregate.group import Roles
from llmc.runtime.server.metrics import ServerMetrics

# Steps of 2^(1/2): `llmc bench --url` reads percentiles from these buckets, each within 41% of its value
_SECONDS_BUCKETS = tuple(1e-4 * 2 ** (e / 2) for e in range(35))   # 0.1 ms .. 13 s
_BYTES_BUCKETS = tuple(2 ** (e / 2) for e in range(24, 65))        # 4 KiB .. 4 GiB


class DisaggregateMetrics(ServerMetrics):
    """The server's metrics, and the KV transfers and engines of a disaggregated one."""

    def __init__(self, model_name: str, roles: Roles):
        super().__init__(model_name)
        counter, histogram = self._family(Counter), self._family(Histogram)
        self.kv_transfer_bytes = counter("kv_transfer_bytes", "KV bytes moved from prefill to decode engines.")
        self.kv_transfer_seconds = histogram(
            "kv_transfer_seconds", "Per request: its KV blocks packed on the prefill engine and received on the "
            "decode engine.", buckets=_SECONDS_BUCKETS)
        self.kv_transfer_hold_seconds = histogram(
            "kv_transfer_hold_seconds", "Per request, within kv_transfer_seconds: from the handoff's notice reaching "
            "the decode engine to its answer of how many prompt blocks its prefix cache holds (its engine thread "
            "answers between steps).", buckets=_SECONDS_BUCKETS)
        self.kv_transfer_request_bytes = histogram("kv_transfer_request_bytes", "Per request: the KV bytes moved.",
                                                   buckets=_BYTES_BUCKETS)

        def engine_gauge(name, doc):
            gauge = Gauge(f"llmc:{name}", doc, ["model_name", "engine"], registry=self.registry)
            return {r: gauge.labels(engine=roles.name(r), **self.labels) for r in roles.engine_ranks}
        self.engine_up = engine_gauge("engine_up", "1 while the engine process serves, 0 once it exited or stopped "
                                      "answering.")
        self.engine_free_blocks = engine_gauge("engine_kv_free_blocks", "The engine's free KV blocks (prefix-cached "
                                               "ones included), as it last reported.")
        self.engine_blocks = engine_gauge("engine_kv_blocks", "The engine's KV blocks.")
        self.engine_kv_unsent_bytes = engine_gauge("engine_kv_unsent_bytes", "Prefill: the packed KV bytes of "
                                                   "handoffs not yet sent to their decode engines, as it last "
                                                   "reported.")
        self.kv_transfer_dropped = counter("kv_transfer_dropped", "Handoffs whose KV a prefill engine dropped unsent "
                                           "because the router declared their decode engine gone.")
        self.engine_requests = engine_gauge("engine_requests", "Requests the engine holds: running, waiting, and "
                                            "(decode) handed over but not yet taken in.")
        def role_counter(name, doc):
            count = Counter(f"llmc:{name}", doc, ["model_name", "role"], registry=self.registry)
            return {role: count.labels(role=role, **self.labels) for role in ("prefill", "decode")}
        self.affinity_hits = role_counter("prefix_affinity_hits", "Requests routed to the engine of this role that "
                                          "holds the longest cached prefix of their prompt (prefix affinity).")
        self.affinity_overloaded = role_counter("prefix_affinity_overloaded", "Requests whose prompt's cached "
                                                "prefix is on an engine of this role too busy to take them (sent to "
                                                "the least loaded instead).")
        for up in self.engine_up.values():
            up.set(1)

    def engine_counters(self) -> dict[str, Counter]:
        """The server's counters that add up the engines' running totals, by their names in an engine's
        stats (the speculative ones: decode engines that speculate)."""
        return {"prefix_queries": self.prefix_queries, "prefix_hits": self.prefix_hits,
                "preemptions": self.preemptions, "kv_dropped": self.kv_transfer_dropped,
                "spec_drafts": self.spec_drafts, "spec_draft_tokens": self.spec_draft_tokens,
                "spec_accepted": self.spec_accepted}
