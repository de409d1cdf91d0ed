"""The router's metric names the alert rules and the dashboard use (sglang-router 0.3.2's own; the live-router
test checks each one is in its real /metrics), and the recording rule's name."""

ROUTER_METRICS = frozenset(
    {
        "smg_worker_health",
        "smg_worker_cb_outcomes_total",
        "smg_router_requests_total",
        "smg_worker_retries_total",
        "smg_router_request_duration_seconds_bucket",
    }
)
RECORDED = frozenset({"sglang_router:expected_workers"})
