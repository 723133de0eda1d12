# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The sweep's engine-free logic (bench/sweep/grid.py, bench/sweep/report.py): run names, the grid, workloads, the target verdicts, per-thread CPU."""

from __future__ import annotations

from bench.sweep.grid import Point, build_grid, make_workload, requests_for, shared_prefix_len
from bench.sweep.measure import KV_BYTES_PER_TOKEN, KvGeometry, expected_kv_bytes, kv_geometry, missing_kv_bytes, thread_breakdown
from bench.sweep.report import cpu_verdict, per_thread, targets, upstream_side_table

MODES = ("kvpush", "upstream-push", "pull")


def test_run_names_follow_the_seed_study():
    assert Point(1024, 4.0, 128, 2).run_name("kvpush") == "kvpush_qps4_in1024_out128_iter2"
    assert Point(256, 0.5, 16, 1).run_name("pull") == "pull_qps0.5_in256_out16_iter1"


def test_grid_puts_iterations_outermost_and_covers_every_point_once_per_iteration():
    grid = build_grid([256, 1024], [1, 4], [16], iterations=2)
    assert len(grid) == 8 and len(set(grid)) == 8
    assert {p.iteration for p in grid[:4]} == {1} and {p.iteration for p in grid[4:]} == {2}
    assert {(p.input_len, p.qps) for p in grid[:4]} == {(256, 1), (256, 4), (1024, 1), (1024, 4)}


def test_workloads_are_reproducible_and_spread_the_checked_requests():
    point = Point(256, 8.0, 16, 1)
    n = requests_for(8.0, 12.0, 24)
    a, b = make_workload(point, n, 4, seed=0), make_workload(point, n, 4, seed=0)
    assert n == 96 and a.prompts == b.prompts and a.offsets_s == b.offsets_s
    assert a.checked == [0, 32, 63, 95] and all(len(p) == 256 for p in a.prompts)
    assert a.offsets_s == sorted(a.offsets_s) and a.offsets_s[0] == 0.0
    assert make_workload(Point(256, 8.0, 16, 2), n, 4, seed=0).prompts != a.prompts
    assert requests_for(1.0, 12.0, 24) == 24


def row(qps, kvpush, upstream_push, pull, tpot_ratio, overheads=(4.0,), sustained=True, owned=(1.5,), input_len=256):
    """One point_table row as the report builds it (pooled p50s per mode)."""
    ttfts = {"kvpush": kvpush, "upstream-push": upstream_push, "pull": pull}
    modes = {m: {"ttft_p50_ms": t, "tpot_p50_ms": 8.0, "sustained": sustained} for m, t in ttfts.items()}
    modes["kvpush"]["handoff_overhead_p50_ms_per_iteration"] = list(overheads)
    modes["kvpush"]["owned_handoff_p50_ms_per_iteration"] = list(owned)
    return {"input_len": input_len, "output_len": 16, "qps": qps, "modes": modes, "best_upstream_ttft_p50_ms": min(upstream_push, pull),
            "ttft_ratio_best_upstream_over_kvpush": min(upstream_push, pull) / kvpush,
            "tpot_ratio_kvpush_over_upstream_push": tpot_ratio}


def test_targets_met_when_kvpush_wins_everywhere_by_enough_at_the_top_load():
    verdict = targets([row(1, 30.0, 33.0, 35.0, 0.9), row(8, 40.0, 62.0, 60.0, 1.0)], MODES)
    assert verdict["ttft_below_both_everywhere"]["met"]
    assert verdict["ttft_ratio_at_high_load"]["met"]
    assert verdict["ttft_ratio_at_high_load"]["per_series"][0]["highest_qps_all_modes_keep_up"] == 8
    assert verdict["tpot_no_worse_than_upstream_push"]["met"]
    assert verdict["handoff_overhead_p50"]["met"]


def test_targets_name_the_points_that_miss():
    rows = [row(1, 30.0, 29.0, 35.0, 1.2, overheads=(6.0, 4.0)), row(8, 40.0, 45.0, 44.0, 0.9),
            row(16, 90.0, 80.0, 85.0, 1.0, sustained=False)]
    verdict = targets(rows, MODES)
    assert verdict["ttft_below_both_everywhere"] == {"met": False, "points": 3, "missed_at": [(256, 16, 1), (256, 16, 16)]}
    high = verdict["ttft_ratio_at_high_load"]
    # QPS 16 did not keep up, so the judged point is QPS 8, where 44/40 = 1.1 < 1.5.
    assert not high["met"] and high["per_series"][0]["highest_qps_all_modes_keep_up"] == 8
    assert high["per_series"][0]["highest_qps"] == 16
    assert verdict["tpot_no_worse_than_upstream_push"]["worse_at"] == [(256, 16, 1, 1.2)]
    assert verdict["handoff_overhead_p50"]["above_target_at"] == [(256, 16, 1)]


def test_the_owned_hand_off_is_judged_at_256_tokens_up_to_qps_4_only():
    rows = [row(1, 30.0, 33.0, 35.0, 0.9, owned=(1.2, 1.9)), row(4, 35.0, 40.0, 41.0, 0.9, owned=(1.8,)),
            row(8, 40.0, 62.0, 60.0, 1.0, owned=(9.0,)), row(1, 90.0, 99.0, 98.0, 1.0, owned=(7.0,), input_len=1024)]
    owned = targets(rows, MODES)["owned_handoff_p50"]
    assert owned["met"] and owned["per_run"] == [(256, 16, 1, 1.2), (256, 16, 1, 1.9), (256, 16, 4, 1.8)]
    rows[1] = row(4, 35.0, 40.0, 41.0, 0.9, owned=(1.8, 2.4))
    assert not targets(rows, MODES)["owned_handoff_p50"]["met"]
    assert not targets([row(8, 40.0, 62.0, 60.0, 1.0)], MODES)["owned_handoff_p50"]["met"]  # nothing judged: not met


def test_targets_need_all_three_modes():
    assert targets([row(1, 30.0, 33.0, 35.0, 0.9)], ("kvpush", "upstream-push")) == {"note": "targets need all three modes"}


def side(qps, mode, p_ms, d_ms):
    return {"input_len": 256, "output_len": 16, "qps": qps, "mode": mode, "cpu_ms_per_request_p": p_ms, "cpu_ms_per_request_d": d_ms}


def test_cpu_target_compares_kvpush_with_upstream_push_on_each_engine():
    met = cpu_verdict([side(1, "kvpush", 40.0, 80.0), side(1, "upstream-push", 100.0, 100.0), side(1, "pull", 1.0, 1.0)])
    assert met["met"] and [{k: r[k] for k in ("point", "p", "d")} for r in met["ratios"]] == [{"point": (256, 16, 1), "p": 0.4, "d": 0.8}]
    missed = cpu_verdict([side(1, "kvpush", 40.0, 81.0), side(1, "upstream-push", 100.0, 100.0)])
    assert not missed["met"] and missed["ratios"][0]["d"] == 0.81
    assert not cpu_verdict([side(1, "kvpush", 40.0, 80.0)])["met"]  # nothing to compare with


def test_cpu_ratios_are_also_given_per_iteration():
    kv = side(1, "kvpush", 45.0, 80.0) | {"cpu_ms_per_request_per_iteration": {"P": [40.0, 50.0], "D": [80.0, None]}}
    up = side(1, "upstream-push", 50.0, 100.0) | {"cpu_ms_per_request_per_iteration": {"P": [50.0, 50.0], "D": [100.0, 100.0]}}
    (ratios,) = cpu_verdict([kv, up])["ratios"]
    assert ratios["p_per_iteration"] == [0.8, 1.0] and ratios["d_per_iteration"] == [0.8, None]


def test_per_iteration_cpu_ratios_pair_runs_of_the_same_iteration_when_one_was_skipped():
    """kvpush's first iteration was skipped: its one run is iteration 2's, and is compared with upstream push's iteration 2."""
    kv = side(1, "kvpush", 60.0, 90.0) | {"cpu_ms_per_request_per_iteration": {"P": [60.0], "D": [90.0]}, "iterations": [2]}
    up = side(1, "upstream-push", 45.0, 95.0) | {"cpu_ms_per_request_per_iteration": {"P": [30.0, 60.0], "D": [90.0, 100.0]}, "iterations": [1, 2]}
    (ratios,) = cpu_verdict([kv, up])["ratios"]
    assert ratios["p_per_iteration"] == [None, 1.0] and ratios["d_per_iteration"] == [None, 0.9]


def test_the_side_table_says_which_iteration_each_run_is():
    def document(mode, iteration, p_ms):
        summary = {"router": {"p_leg_ms": {"p50": 1.0}, "after_p_leg_ms": {"p50": 1.0}},
                   "engines": {e: {"queue_s": 0.0, "prefill_s": 0.0} for e in ("P", "D")}, "kv_bytes": {}, "cores_used": {mode: {"P": 0.1, "D": 0.1}},
                   "cpu_ms_per_request": {"P": p_ms, "D": 1.0}}
        return {"mode": mode, "point": {"input_len": 256, "output_len": 16, "qps": 1.0, "iteration": iteration}, "summary": summary}

    skipped = {"mode": "kvpush", "point": {"input_len": 256, "output_len": 16, "qps": 1.0, "iteration": 1}, "skipped": "P did not keep up"}
    rows = upstream_side_table([document("upstream-push", 2, 50.0), skipped, document("kvpush", 2, 40.0), document("upstream-push", 1, 20.0)])
    by_mode = {r["mode"]: r for r in rows}
    assert by_mode["kvpush"]["iterations"] == [2] and by_mode["upstream-push"]["iterations"] == [1, 2]
    assert by_mode["upstream-push"]["cpu_ms_per_request_per_iteration"]["P"] == [20.0, 50.0]
    assert cpu_verdict(rows)["ratios"][0]["p_per_iteration"] == [None, 0.8]


def test_thread_cpu_is_listed_per_iteration_for_each_engine():
    runs = [{"thread_cpu_ms_per_request": {"D": {"VLLM::Worker/kvpush-consumer": 2.5, "VLLM::Worker/VLLM::Worker": 190.0}}},
            {"thread_cpu_ms_per_request": {"D": {"VLLM::Worker/kvpush-consumer": 1.5}, "P": {"python/python": 10.0}}},
            {}]  # a run from before per-thread readings
    assert per_thread(runs) == {"D": {"VLLM::Worker/kvpush-consumer": [2.5, 1.5], "VLLM::Worker/VLLM::Worker": [190.0]},
                                "P": {"python/python": [10.0]}}
    waits = [{"thread_runqueue_wait_ms_per_request": {"P": {"VLLM::Worker/VLLM::Worker": 40.8}}}, runs[0]]
    assert per_thread(waits, "thread_runqueue_wait_ms_per_request") == {"P": {"VLLM::Worker/VLLM::Worker": [40.8]}}


def outside(mode, p_leg, after, qps=8):
    return {"input_len": 256, "output_len": 16, "qps": qps, "mode": mode, "p_leg_p50_ms": p_leg, "after_p_leg_p50_ms": after}


def test_the_high_load_ratio_is_bounded_by_the_shortest_p_leg_of_any_mode():
    rows = [row(1, 30.0, 33.0, 35.0, 0.9), row(8, 50.0, 70.0, 60.0, 1.0)]
    side_rows = [outside("kvpush", 45.0, 5.0), outside("upstream-push", 42.0, 28.0), outside("pull", 40.0, 20.0),
                 outside("kvpush", 1.0, 1.0, qps=1)]  # another point's legs are not read
    top = targets(rows, MODES, side_rows)["ttft_ratio_at_high_load"]["per_series"][0]
    # Better upstream TTFT 60 ms; the shortest P leg is pull's 40 ms; kvpush's 5 ms after its P leg, its decode step 8 ms (row()).
    assert top["shortest_p_leg_mode"] == "pull" and top["shortest_p_leg_ms"] == 40.0 and top["kvpush_after_p_leg_ms"] == 5.0
    assert top["bound_with_shortest_p_leg"] == 60.0 / 45.0 and top["bound_with_one_decode_step_after_it"] == 60.0 / 48.0
    assert "bound_with_shortest_p_leg" not in targets(rows, MODES)["ttft_ratio_at_high_load"]["per_series"][0]  # no outside view


def test_the_cpu_bound_takes_kvpush_s_own_threads_out_of_its_engines():
    kv = side(1, "kvpush", 50.0, 100.0) | {"runs": 2, "thread_cpu_ms_per_request": {
        "P": {"VLLM::Worker/kvpush-producer": [4.0, 2.0], "VLLM::Worker/event_engine": [2.0], "VLLM::Worker/VLLM::Worker": [40.0, 40.0]},
        "D": {"VLLM::Worker/VLLM::Worker": [90.0, 90.0]}}}
    verdict = cpu_verdict([kv, side(1, "upstream-push", 50.0, 100.0)])
    # P: (4 + 2 + 2) / 2 runs = 4 ms per request of kvpush's threads, so (50 - 4) / 50; D has none of them.
    assert verdict["ratios"][0]["p"] == 1.0 and verdict["ratios"][0]["p_without_kvpush_threads"] == 46.0 / 50.0
    assert verdict["ratios"][0]["d_without_kvpush_threads"] == 1.0
    assert verdict["ratios"][0]["p_tracing_threads_ms"] == 0.0  # the producer and gRPC's threads are not tracing's


def test_tracing_s_threads_are_told_apart_from_kvpush_s_others():
    kv = side(1, "kvpush", 50.0, 100.0) | {"runs": 2, "thread_cpu_ms_per_request": {
        "P": {"VLLM::Worker/kvpush-spans-pre": [1.0, 0.5], "VLLM::Worker/kvpush-otel-exp": [1.5, 1.0], "VLLM::Worker/kvpush-producer": [4.0]},
        "D": {"VLLM::Worker/VLLM::Worker": [90.0, 90.0]}}}
    ratios = cpu_verdict([kv, side(1, "upstream-push", 50.0, 100.0)])["ratios"][0]
    assert ratios["p_tracing_threads_ms"] == 2.0 and ratios["p_without_kvpush_threads"] == 46.0 / 50.0
    assert ratios["d_tracing_threads_ms"] == 0.0
    assert cpu_verdict([side(1, "kvpush", 50.0, 100.0), side(1, "upstream-push", 50.0, 100.0)])["ratios"][0]["p_without_kvpush_threads"] is None


def test_thread_cpu_lists_each_thread_from_the_floor_up_per_request():
    before = {"P/kvpush-control-": 1.0, "P/event_engine": 2.0, "P/gone": 1.0}
    after = {"P/kvpush-control-": 1.030, "P/event_engine": 2.020, "P/new": 0.005}  # 100 requests: 0.3, 0.2 and 0.05 ms each
    assert thread_breakdown(before, after, 100) == {"P/kvpush-control-": 0.3}


def test_a_shared_prefix_workload_shares_that_fraction_of_every_prompt_and_no_more():
    point = Point(1024, 4.0, 16, 1)
    work = make_workload(point, 6, 2, seed=0, shared_prefix=0.75)
    shared = shared_prefix_len(1024, 0.75)
    assert shared == 768 and all(len(p) == 1024 for p in work.prompts)
    assert all(p[:shared] == work.prompts[0][:shared] for p in work.prompts)
    assert len({tuple(p[shared:shared + 8]) for p in work.prompts}) == len(work.prompts)  # suffixes differ at once
    # The same for every mode (same seed), another prefix at another point or iteration.
    assert make_workload(point, 6, 2, seed=0, shared_prefix=0.75).prompts == work.prompts
    assert make_workload(Point(1024, 4.0, 16, 2), 6, 2, seed=0, shared_prefix=0.75).prompts[0][:shared] != work.prompts[0][:shared]
    assert make_workload(point, 6, 2, seed=0).prompts != work.prompts


def test_bytes_a_transfer_moves_once_d_caches_the_shared_prefix():
    # kvpush, 1,023 tokens: 8 blocks; D holds the 768-token prefix's 6 whole blocks, so 2 move.
    assert missing_kv_bytes(1023, 768) == 2 * 128 * KV_BYTES_PER_TOKEN
    assert missing_kv_bytes(1023, 700) == 3 * 128 * KV_BYTES_PER_TOKEN  # a partly filled block is not cached
    assert missing_kv_bytes(255, 0) == expected_kv_bytes(255) == 2 * 128 * KV_BYTES_PER_TOKEN


def test_the_kv_geometry_of_each_tiny_model_family():
    from kvpush.dev.tinymodel.architectures import DEEPSEEK_V2_CONFIG, QWEN3_CONFIG

    assert kv_geometry(QWEN3_CONFIG) == KvGeometry(128, KV_BYTES_PER_TOKEN)
    mla = kv_geometry(DEEPSEEK_V2_CONFIG)
    assert mla == KvGeometry(16, 2 * 576 * 4)  # one latent plane per layer, no K/V split
    assert expected_kv_bytes(299, mla) == 19 * 16 * 2 * 576 * 4
