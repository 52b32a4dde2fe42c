"""scripts/bench/sweep_tile_configs.py on CPU: the candidate lists it hands the tuner (the table's own first, then
its grid, no duplicates; a compile worker's shard), and its report of every tuned kernel."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))

import sweep_tile_configs as sweep  # noqa: E402
from attn.kernels import runtime, softmax_family, threshold_family  # noqa: E402


def test_wide_candidates_put_the_table_first_then_the_grid(monkeypatch):
    monkeypatch.setattr(softmax_family, "interpreting", lambda: False)  # the GPU's lists, here on the CPU
    monkeypatch.setattr(runtime, "interpreting", lambda: False)
    own = softmax_family.CONFIG_TABLE.candidates("kv", n=4096)
    with sweep.wide_candidates("softmax"):
        wide = softmax_family.CONFIG_TABLE.candidates("kv", n=4096)
        small = softmax_family.CONFIG_TABLE.candidates("kv", n=64)
    assert wide[:len(own)] == own and len(set(wide)) == len(wide)
    assert set(wide) == set(own) | set(sweep.KV_GRID)
    assert small == own[:1]  # a launch of <= 64 rows keeps its one untimed config
    assert softmax_family.CONFIG_TABLE.candidates("kv", n=4096) == own  # restored
    shards = []
    for w in range(3):
        with sweep.wide_candidates("softmax", (w, 3)):
            shards.append(softmax_family.CONFIG_TABLE.candidates("kv", n=4096))
    assert [c for shard in shards for c in shard] != wide and sorted(map(str, sum(shards, []))) == sorted(map(str, wide))


def test_wide_candidates_cover_the_threshold_kinds(monkeypatch):
    monkeypatch.setattr(threshold_family, "interpreting", lambda: False)
    monkeypatch.setattr(runtime, "interpreting", lambda: False)
    with sweep.wide_candidates("threshold"):
        for kind, grid in sweep.GRIDS["threshold"].items():
            got = threshold_family.CONFIG_TABLE.candidates(kind, 128, True, 1 if kind == "dkdv" else 0)
            assert set(grid) <= set(got), kind


def test_kernel_report_lists_each_tuning_fastest_first(monkeypatch):
    sweep.reset_tuning()
    fast, slow = runtime.TileConfig(64, 64, 4, 3), runtime.TileConfig(128, 64, 8, 3)
    kernel = softmax_family._DKDV
    monkeypatch.setitem(kernel.timings, ("a",), {slow: 2.0, fast: 1.0})
    monkeypatch.setitem(kernel.tuned, ("a",), fast)
    report = sweep.kernel_report()
    assert report[kernel.name] == {"chosen": str(fast), "times": [[str(fast), 1.0], [str(slow), 2.0]]}
    sweep.reset_tuning()
    assert kernel.name not in sweep.kernel_report()


def test_reset_tuning_forgets_the_backward_forms(monkeypatch):
    monkeypatch.setitem(softmax_family._dq_forms, ("k",), "one_pass")
    monkeypatch.setitem(threshold_family._dkdv_diff_form, ("k",), "fused")
    assert sweep.kernel_report()["softmax backward dq form"]["chosen"] == "one_pass"
    sweep.reset_tuning()
    assert not softmax_family._dq_forms and not threshold_family._dkdv_diff_form
