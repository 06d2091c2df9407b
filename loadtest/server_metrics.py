"""`/metrics` before and after a level: counter deltas, and τ from the DFlash counters.

τ (mean acceptance length, bonus token included) = 1 + Δaccepted / Δdrafts over the level,
the PromQL of `dflash_sglang.metrics` applied to two scrapes. None on a server without
speculation (no DFlash counters, or nothing drafted).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import requests
from prometheus_client.parser import text_string_to_metric_families

from dflash_sglang import metrics

_CUMULATIVE_SUFFIXES = ("_total", "_count", "_sum", "_bucket")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


@dataclass(frozen=True)
class Snapshot:
    """Samples keyed `name{label="value",...}`; counters (and histogram `_bucket`/`_count`/`_sum`),
    which only grow, apart from gauges, which are read as they are."""

    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)


def sample_key(name: str, labels: dict[str, str]) -> str:
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def split_key(key: str) -> tuple[str, dict[str, str]]:
    """`sample_key`'s inverse: the sample's name and labels."""
    name, _, rest = key.partition("{")
    return name, dict(_LABEL.findall(rest))


def parse(text: str) -> Snapshot:
    snapshot = Snapshot()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample_key(sample.name, sample.labels)
            if family.type == "gauge":
                snapshot.gauges[key] = sample.value
            elif family.type in ("counter", "histogram", "summary") and sample.name.endswith(
                _CUMULATIVE_SUFFIXES
            ):
                snapshot.counters[key] = sample.value
    return snapshot


def scrape(base_url: str, timeout_s: float = 30.0) -> Snapshot | None:
    """None when the server exports no metrics (launched without `--enable-metrics`)."""
    r = requests.get(base_url.rstrip("/") + "/metrics", timeout=timeout_s)
    if r.status_code == 404:
        return None
    r.raise_for_status()
    return parse(r.text)


def counter_deltas(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """after − before for every counter that moved (a counter new since `before` counts
    from 0)."""
    deltas = {k: v - before.counters.get(k, 0.0) for k, v in after.counters.items()}
    return {k: v for k, v in deltas.items() if v}


def total(samples: dict[str, float], name: str) -> float:
    """Summed over label sets (e.g. one series per scheduler process): counter deltas or
    a snapshot's gauges."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def step_time(deltas: dict[str, float]) -> dict[str, dict]:
    """Mean measured and predicted step time per option over the deltas' interval
    (`metrics.step_time_means`)."""
    samples = [(*split_key(key), value) for key, value in deltas.items()]
    return metrics.step_time_means(metrics.step_time_sums(samples))


def tau(deltas: dict[str, float]) -> float | None:
    return metrics.tau(total(deltas, metrics.ACCEPTED), total(deltas, metrics.DRAFTS))


def held_kv_rows(base_url: str, headers: dict[str, str] | None = None) -> int:
    """KV rows held by requests right now (SGLang's `/v1/loads`; evictable radix-cached
    prefixes are not counted). The draft shares the target's row allocator, so 0 means both
    pools are free."""
    r = requests.get(base_url.rstrip("/") + "/v1/loads", headers=headers, timeout=30)
    r.raise_for_status()
    return sum(load["num_used_tokens"] for load in r.json()["loads"])
