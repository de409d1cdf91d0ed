"""A canary's share of real traffic, judged: the shadow's errors and latency against live's.

While the shadow is one more worker of the routers (roles/sglang_canary, tasks/traffic.yml), both sides
serve real requests. The play reads, before and after that window, the routers' Prometheus metrics
(`smg_worker_cb_outcomes_total{worker, outcome}`: every answer of every worker, success or failure) and
both engines' own `/metrics` (`sglang:e2e_request_latency_seconds`, a histogram). The differences are
the window: requests, failures, mean and median latency per side. The shadow passes when it served
enough requests, failed no more often than live (plus an allowed increase), and was not much slower.

The evidence is checked before it is judged: a counter that went down over the window, or that is missing
(no outcome recorded for a worker under any spelling of its URL, no latency histogram) aborts with the
reason; a counter that is not a finite number is bad input (exit 2), as everywhere else; never a promotion
on figures that cannot be read.

Run by the play on the controller as `python -m ddtree_runtime.ops.canary_traffic` with one JSON
document on stdin; prints one JSON report. Exit 0 promote, 1 abort, 2 bad input (text that is not
Prometheus', a counter, bucket bound or count that is not a finite number: the verdict is abort then too).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from ddtree_runtime.inputs.router_answers import worker_url as normal_url
from ddtree_runtime.inputs.values import InputError

EXIT_PROMOTE, EXIT_ABORT, EXIT_BAD_INPUT = 0, 1, 2
OUTCOMES = "smg_worker_cb_outcomes_total"
LATENCY = "sglang:e2e_request_latency_seconds"


class TrafficInputError(ValueError):
    """The document is not what the play sends: exit 2 with what was wrong."""


@dataclass(frozen=True)
class Thresholds:
    min_requests: int = 20
    max_error_rate_increase: float = 0.0
    max_latency_ratio: float = 1.5
    latency_slack_s: float = 0.1


@dataclass(frozen=True)
class Side:
    """One worker over the window."""

    url: str
    requests: int  # answered by the engine (its e2e histogram's count)
    successes: int  # the routers' outcomes for this worker
    failures: int
    latency_mean_s: float | None
    latency_p50_s: float | None
    evidence: tuple[str, ...] = ()  # why its counters cannot be trusted (each one aborts)

    @property
    def error_rate(self) -> float:
        attempts = self.successes + self.failures
        return self.failures / attempts if attempts else 0.0


def _samples(text: Any) -> list[tuple[str, dict[str, str], float]]:
    if not isinstance(text, str):
        raise TrafficInputError(f"metrics must be Prometheus text: got {type(text).__name__}")
    try:
        return [
            (s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples
        ]
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise TrafficInputError(f"not Prometheus text: {str(exc)[:200]}") from None


def _same_worker(label: Any, url: str) -> bool:
    """The routers' worker label names `url` in any spelling (case, default port, trailing '/')."""
    try:
        return normal_url(label) == normal_url(url)
    except InputError:
        return False


def outcomes(router_texts: list[str], url: str) -> tuple[float, float, bool]:
    """(successes, failures, any series at all) the routers counted for worker `url` (summed over
    routers and over the spellings of its URL). A value that is not finite stays in the sums: the
    caller refuses it as bad input."""
    ok = bad = 0.0
    seen = False
    for text in router_texts:
        for name, labels, value in _samples(text):
            if name == OUTCOMES and _same_worker(labels.get("worker"), url):
                seen = True
                if labels.get("outcome") == "success":
                    ok += value
                else:
                    bad += value
    return ok, bad, seen


def latency(text: str) -> tuple[float, float, dict[float, float]]:
    """(count, sum, cumulative buckets by upper bound) of the engine's e2e latency histogram, summed over
    label sets (SGLang adds some per model, per rank). A bucket whose bound or count is not a number
    (NaN, +Inf counts, words) is TrafficInputError; a count or sum that is not finite stays in for the
    caller to refuse."""
    count = total = 0.0
    buckets: dict[float, float] = {}
    for name, labels, value in _samples(text):
        if name == LATENCY + "_count":
            count += value
        elif name == LATENCY + "_sum":
            total += value
        elif name == LATENCY + "_bucket":
            try:
                le = float(labels["le"])
            except (KeyError, ValueError):
                raise TrafficInputError(f"{LATENCY} has a bucket without a numeric le: {labels}") from None
            if math.isnan(le) or not math.isfinite(value):
                raise TrafficInputError(f"{LATENCY} bucket le={labels['le']} holds {value!r}: not a count")
            buckets[le] = buckets.get(le, 0.0) + value
    return count, total, buckets


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' histogram_quantile over cumulative buckets (linear inside the bucket)."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        if buckets[bound] >= rank:
            if math.isinf(bound):
                return lower
            inside = buckets[bound] - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 0.0)
        lower, below = bound, buckets[bound]
    return lower


def _evidence(
    url: str, before: dict[str, float], after: dict[str, float], seen: bool, has_latency: bool
) -> list[str]:
    """Why the counters of `url` over the window cannot be judged (empty when they can); a counter that
    is not a finite number is not evidence at all (TrafficInputError: exit 2)."""
    why = []
    for name in after:
        if not (math.isfinite(before[name]) and math.isfinite(after[name])):
            raise TrafficInputError(f"{url}: {name} is not a finite number ({before[name]!r} -> "
                                    f"{after[name]!r}): a counter counts")  # fmt: skip
        if after[name] < before[name]:
            why.append(f"{url}: {name} went down ({before[name]:g} -> {after[name]:g}): did it restart?")
    if not seen:
        why.append(
            f"{url}: the routers recorded no outcome for it (no {OUTCOMES} series under any spelling "
            "of its URL): its failures cannot be counted"
        )
    if not has_latency:
        why.append(f"{url}: its engine reports no {LATENCY} histogram")
    return why


def side(url: str, routers: tuple[list[str], list[str]], engine: tuple[str, str]) -> Side:
    ok0, bad0, _ = outcomes(routers[0], url)
    ok1, bad1, seen = outcomes(routers[1], url)
    c0, s0, b0 = latency(engine[0])
    c1, s1, b1 = latency(engine[1])
    before = {"successes": ok0, "failures": bad0, "request count": c0, "latency sum": s0}
    after = {"successes": ok1, "failures": bad1, "request count": c1, "latency sum": s1}
    for le in sorted(set(b0) | set(b1)):
        before[f"bucket le={le:g}"], after[f"bucket le={le:g}"] = b0.get(le, 0.0), b1.get(le, 0.0)
    evidence = _evidence(url, before, after, seen, bool(b1))
    if evidence:
        return Side(
            url=url,
            requests=0,
            successes=0,
            failures=0,
            latency_mean_s=None,
            latency_p50_s=None,
            evidence=tuple(evidence),
        )
    window = {le: b1.get(le, 0.0) - b0.get(le, 0.0) for le in b1}
    requests = round(c1 - c0)
    return Side(
        url=url,
        requests=requests,
        successes=round(ok1 - ok0),
        failures=round(bad1 - bad0),
        latency_mean_s=round((s1 - s0) / requests, 4) if requests else None,
        latency_p50_s=None if not requests else round(quantile(0.5, window) or 0.0, 4),
    )


def _figure_reasons(live: Side, shadow: Side, t: Thresholds) -> list[str]:
    reasons = []
    if shadow.requests < t.min_requests:
        reasons.append(
            f"the shadow served {shadow.requests} request(s) of real traffic, fewer than the "
            f"{t.min_requests} needed to judge it: lengthen sglang_canary_traffic_s or lower "
            "sglang_canary_traffic_requests"
        )
    if shadow.error_rate > live.error_rate + t.max_error_rate_increase:
        reasons.append(
            f"the shadow failed {shadow.failures} of {shadow.successes + shadow.failures} requests "
            f"({shadow.error_rate:.1%}), live {live.failures} of {live.successes + live.failures} "
            f"({live.error_rate:.1%}); allowed: live's rate + {t.max_error_rate_increase:.1%}"
        )
    if live.latency_mean_s is not None and shadow.latency_mean_s is not None:
        bound = t.max_latency_ratio * live.latency_mean_s + t.latency_slack_s
        if shadow.latency_mean_s > bound:
            reasons.append(
                f"the shadow's mean latency {shadow.latency_mean_s:.3f} s is above {bound:.3f} s "
                f"({t.max_latency_ratio:g} x live's {live.latency_mean_s:.3f} s + "
                f"{t.latency_slack_s:g} s)"
            )
    return reasons


def judge(live: Side, shadow: Side, t: Thresholds, window_s: float | None = None) -> dict[str, Any]:
    # Counters that cannot be read are the whole answer: the figures from them would be made up.
    reasons = [f"evidence that cannot be judged: {why}" for why in (*live.evidence, *shadow.evidence)]
    reasons = reasons or _figure_reasons(live, shadow, t)
    verdict = "abort" if reasons else "promote"
    table = [
        f"{'':8}{'requests':>9}{'failed':>8}{'error rate':>12}{'mean s':>9}{'p50 s':>8}",
        *(
            f"{name:8}{s.requests:>9}{s.failures:>8}{s.error_rate:>12.1%}"
            f"{_fmt(s.latency_mean_s):>9}{_fmt(s.latency_p50_s):>8}"
            for name, s in (("live", live), ("shadow", shadow))
        ),
        f"canary traffic {verdict.upper()}"
        + (
            f": {'; '.join(reasons)}"
            if reasons
            else f" ({shadow.requests} real requests in {window_s or 0:.0f} s)"
        ),
    ]
    return {
        "ok": not reasons,
        "verdict": verdict,
        "reason": "; ".join(reasons) or None,
        "window_s": window_s,
        "live": {**asdict(live), "error_rate": live.error_rate},
        "shadow": {**asdict(shadow), "error_rate": shadow.error_rate},
        "thresholds": asdict(t),
        "table": table,
    }


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def run(doc: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise TrafficInputError("stdin must hold one JSON object")
    try:
        routers = (list(doc["routers_before"]), list(doc["routers_after"]))
        live = side(str(doc["live_url"]), routers, (doc["live_before"], doc["live_after"]))
        shadow = side(str(doc["shadow_url"]), routers, (doc["shadow_before"], doc["shadow_after"]))
        thresholds = Thresholds(**(doc.get("thresholds") or {}))
    except (KeyError, TypeError) as exc:
        raise TrafficInputError(f"missing or malformed field: {exc}") from exc
    for name, value in asdict(thresholds).items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
            raise TrafficInputError(f"threshold {name} must be a finite number >= 0: got {value!r}")
    window_s = doc.get("window_s")
    if window_s is not None and (
        isinstance(window_s, bool) or not isinstance(window_s, int | float) or not 0 <= window_s < math.inf
    ):
        raise TrafficInputError(f"window_s must be a finite number of seconds: got {window_s!r:.80}")
    return judge(live, shadow, thresholds, window_s)


def main() -> int:
    try:
        try:
            doc = json.load(sys.stdin)
        except (ValueError, RecursionError) as exc:
            raise TrafficInputError(f"stdin is not JSON: {str(exc)[:200]}") from None
        report = run(doc)
    except TrafficInputError as exc:
        print(
            json.dumps(
                {
                    "ok": False,
                    "verdict": "abort",
                    "reason": f"bad input: {exc}",
                    "table": [f"canary traffic ABORT: bad input: {exc}"],
                }
            )
        )
        return EXIT_BAD_INPUT
    print(json.dumps(report))
    return EXIT_PROMOTE if report["ok"] else EXIT_ABORT


if __name__ == "__main__":
    sys.exit(main())
