# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Prometheus `/metrics` of the stack's processes, and the free KV blocks of a vLLM engine.

vLLM 0.32 exports no free-block count. `free_kv_blocks` derives it from
`vllm:kv_cache_usage_perc` (= 1 - free / (num_gpu_blocks - 1), the null
block excluded; see `BlockPool.get_usage`) and the `num_gpu_blocks` label of
`vllm:cache_config_info`. The gauge is published with the scheduler stats of
engine steps, so an engine that is not stepping does not update it.
"""

from __future__ import annotations

from kvpush.dev.localstack.completions import HttpError, request

Samples = dict[str, list[tuple[dict[str, str], float]]]
SCRAPE_TIMEOUT_S = 10.0


def scrape_metrics(url: str) -> Samples:
    """The server's Prometheus `/metrics`, as name → [(labels, value)] over all samples."""
    from prometheus_client.parser import text_string_to_metric_families

    status, data = request("GET", url + "/metrics", timeout=SCRAPE_TIMEOUT_S)
    if status != 200:
        raise HttpError(status, data)
    samples: Samples = {}
    for family in text_string_to_metric_families(data.decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples


def metric_value(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of metric `name` whose labels include `labels` (0 if none)."""
    return sum(value for lbls, value in scrape_metrics(url).get(name, [])
               if all(lbls.get(k) == v for k, v in labels.items()))


def _engine0_sample(metrics: Samples, name: str) -> tuple[dict[str, str], float]:
    return next(s for s in metrics[name] if s[0].get("engine", "0") == "0")


def num_kv_blocks(url: str) -> int:
    """Total KV blocks of engine 0 (the `num_gpu_blocks` label of `vllm:cache_config_info`)."""
    return int(_engine0_sample(scrape_metrics(url), "vllm:cache_config_info")[0]["num_gpu_blocks"])


def free_kv_blocks(url: str) -> int:
    """Free KV blocks of engine 0, from `vllm:kv_cache_usage_perc` and `num_gpu_blocks`.

    The null block is excluded, as in `BlockPool.get_usage`. With prefix
    caching on, cached-but-unreferenced blocks count as free.
    """
    metrics = scrape_metrics(url)
    total = int(_engine0_sample(metrics, "vllm:cache_config_info")[0]["num_gpu_blocks"])
    usage = _engine0_sample(metrics, "vllm:kv_cache_usage_perc")[1]
    return round((1.0 - usage) * (total - 1))
