"""bench/memory_peak.py's replay of a CUDA allocator trace (the GPU run itself is a benchmark)."""
from bench.memory_peak import by_site, live_at_peak, timeline


def _frames(*names):
    return [{"filename": "/site/torch/_ops.py", "line": 1, "name": "__call__"}] + [
        {"filename": f"/x/{name}.py", "line": i, "name": name} for i, name in enumerate(names)]


def test_the_peak_is_replayed_from_alloc_to_free_completed_and_grouped_by_frames():
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": _frames("mlp", "layer")},
        {"action": "alloc", "addr": 2, "size": 50, "frames": _frames("attn", "layer")},
        {"action": "free_requested", "addr": 1, "size": 100},  # still allocated: a stream uses it
        {"action": "alloc", "addr": 3, "size": 30, "frames": _frames("mlp", "layer")},  # peak: 180
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 4, "size": 60, "frames": _frames("head")},  # 140: below the peak
        {"action": "free_completed", "addr": 99, "size": 10},  # allocated before recording began
    ]
    peak, alive = live_at_peak(trace)
    assert peak == 180 and sorted(e["addr"] for e in alive) == [1, 2, 3]
    assert by_site(alive, depth=1) == [("mlp.py:0:mlp", 130, 2), ("attn.py:0:attn", 50, 1)]
    assert by_site(alive, depth=2)[0][0] == "mlp.py:0:mlp < layer.py:1:layer"


def test_timeline_lists_the_blocks_alive_at_the_peak_with_what_came_before():
    mib = 2**20
    trace = [{"action": "alloc", "addr": a, "size": s * mib} for a, s in ((1, 30), (2, 118), (3, 2), (4, 59))]
    trace.insert(3, {"action": "free_completed", "addr": 2, "size": 118 * mib})
    peak, alive = live_at_peak(trace)
    assert peak == 150 * mib  # 30 + 118 + 2, before the 118 is freed
    lines = timeline(trace, alive, min_mib=1.5, context=1).splitlines()[2:]
    assert lines == ["| 0 | 30.0 |  |", "| 1 | 118.0 | 30.0 |", "| 2 | 2.0 | 118.0 |"]
