"""Prometheus metrics of one station, on a registry of its own (so tests can run several stations in a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0)


class StationMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("jaxstation_requests", "Requests by outcome", ["outcome"], registry=r)
        self.queue_depth = Gauge("jaxstation_queue_depth", "Jobs waiting for a lane", registry=r)
        self.busy_lanes = Gauge("jaxstation_busy_lanes", "Lanes holding a request", registry=r)
        self.ttft = Histogram("jaxstation_time_to_first_token_seconds", "Submit to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram("jaxstation_inter_token_latency_seconds", "Gap between a request's tokens", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.step = Histogram("jaxstation_step_seconds", "Compiled step wall time", ["kind"], registry=r,
                              buckets=LATENCY_BUCKETS)
        self.generated_tokens = Counter("jaxstation_generated_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("jaxstation_prompt_tokens", "Prompt tokens prefilled (not reused)", registry=r)
        self.startup = Gauge("jaxstation_startup_seconds", "Start-up phase durations; phase=ready counts from process "
                             "start to ready", ["phase"], registry=r)
        self.startup_programs = Gauge("jaxstation_startup_programs", "Programs the start-up compiled or read from the "
                                      "persistent compilation cache", ["source"], registry=r)
        self.prefix_lookups = Counter("jaxstation_prefix_cache_lookups", "Requests that looked for a cached prefix",
                                      registry=r)
        self.prefix_hits = Counter("jaxstation_prefix_cache_hits", "Lookups that reused at least one chunk of KV",
                                   registry=r)
        self.prefix_reused_tokens = Counter("jaxstation_prefix_cache_reused_tokens",
                                            "Prompt tokens of hits found in cached prefill-written KV", registry=r)
        self.prefix_tier_saved_tokens = Counter("jaxstation_prefix_cache_tier_saved_tokens",
                                                "Prompt tokens not prefilled, by where their KV was cached: lane (the "
                                                "arena), memory (the host tier) or disk (the disk tier)", ["tier"],
                                                registry=r)
        self.prefix_tier_bytes = Gauge("jaxstation_prefix_cache_memory_bytes", "Bytes of KV in the host tier",
                                       registry=r)
        self.prefix_tier_entries = Gauge("jaxstation_prefix_cache_memory_entries", "Prefixes in the host tier",
                                         registry=r)
        self.prefix_tier_evictions = Counter("jaxstation_prefix_cache_memory_evictions",
                                             "Host tier prefixes dropped, least recently used, to stay in its bytes",
                                             registry=r)
        self.prefix_disk_bytes = Gauge("jaxstation_prefix_cache_disk_bytes", "Bytes of prefix files in the disk tier "
                                       "(--prefix-cache-dir)", registry=r)
        self.prefix_disk_entries = Gauge("jaxstation_prefix_cache_disk_entries", "Prefixes in the disk tier",
                                         registry=r)
        self.prefix_disk_evictions = Counter("jaxstation_prefix_cache_disk_evictions",
                                             "Disk tier files deleted, least recently used, to stay in its bytes",
                                             registry=r)
        self.prefix_disk_dropped = Counter("jaxstation_prefix_cache_disk_dropped",
                                           "Disk tier writes dropped: the writer's queue was full", registry=r)
        self.prefix_disk_load = Histogram("jaxstation_prefix_cache_disk_load_seconds", "Reading and checking a "
                                          "disk tier file into the host tier", registry=r, buckets=LATENCY_BUCKETS)
        self.spec_drafts = Counter("jaxstation_spec_decode_num_drafts", "Drafts verified (one per request per step)",
                                   registry=r)
        self.spec_draft_tokens = Counter("jaxstation_spec_decode_num_draft_tokens", "Tokens drafted", registry=r)
        self.spec_accepted_tokens = Counter("jaxstation_spec_decode_num_accepted_tokens", "Drafted tokens accepted",
                                            registry=r)
        self.prefix_saved_tokens = Counter("jaxstation_prefix_cache_prefill_saved_tokens",
                                           "Prompt tokens not prefilled: the match rounded down to a chunk boundary",
                                           registry=r)

    def count_drafts(self, drafted: int, accepted: int) -> None:
        """A verify step checked `drafted` tokens of one request and accepted `accepted` of them."""
        self.spec_drafts.inc()
        self.spec_draft_tokens.inc(drafted)
        self.spec_accepted_tokens.inc(accepted)

    def count_prefix_lookup(self, matched: int, reused: int, tier: str = "lane") -> None:
        """A request looked for a cached prefix: `matched` prompt tokens found in `tier` (lane, memory or disk),
        `reused` of them not prefilled."""
        self.prefix_lookups.inc()
        if reused:
            self.prefix_hits.inc()
            self.prefix_reused_tokens.inc(matched)
            self.prefix_saved_tokens.inc(reused)
            self.prefix_tier_saved_tokens.labels(tier).inc(reused)


class MeshStationMetrics:
    """A mesh station's metrics: requests by route and outcome, and step wall times by route."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("jaxstation_station_requests", "Mesh station requests by route and outcome",
                                ["route", "outcome"], registry=self.registry)
        self.step = Histogram("jaxstation_station_step_seconds", "Mesh station step wall time by route", ["route"],
                              registry=self.registry, buckets=LATENCY_BUCKETS)

