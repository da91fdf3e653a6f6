"""Checkpoint statistics: Ray metrics on Ray's Prometheus endpoint, and growth warnings."""

from __future__ import annotations

import re
import time
import urllib.request

import pytest
import ray

from raycheckpoint.metrics import CheckpointMetrics
from tests.helpers import manager, train

pytestmark = pytest.mark.timeout(300)


def entry(step: int, stall: float, size: int, kind: str = "full", ok: bool = True) -> dict:
    return {"name": f"step_{step:08d}", "step": step, "kind": kind, "stall_s": stall,
            "bytes": size, "ok": ok, "persist_s": 0.1, "total_s": 0.2}


def test_abnormal_stall_and_size_are_flagged_against_the_recent_median():
    m = CheckpointMetrics("job", window=4, publish=False)
    for step in range(1, 4):  # history is built before anything is judged
        assert m.record(entry(step, 0.10, 1000)) == []
    assert m.record(entry(4, 0.12, 1100)) == []  # ordinary variation
    with pytest.warns(RuntimeWarning, match="blocked 0.500s"):
        [warning] = m.record(entry(5, 0.50, 1000))
    assert "5.0x the median" in warning
    with pytest.warns(RuntimeWarning, match="wider dtype"):
        [warning] = m.record(entry(6, 0.10, 2000))
    assert "2.00x the median" in warning
    # light saves are judged against light saves; failed saves are not history
    assert m.record(entry(7, 0.01, 100, kind="light")) == []
    assert m.record(entry(8, 9.0, 10**9, ok=False)) == []
    # tiny stalls are noise whatever the ratio
    quiet = CheckpointMetrics("job", publish=False)
    for step in range(1, 5):
        quiet.record(entry(step, 0.001, 10))
    assert quiet.record(entry(5, 0.02, 10)) == []


def test_slow_storage_is_flagged_when_persist_and_commit_times_rise():
    m = CheckpointMetrics("job", window=5, publish=False)
    for step in range(1, 5):
        assert m.record({**entry(step, 0.1, 1000), "persist_s": 1.0, "total_s": 1.2}) == []
    with pytest.warns(RuntimeWarning, match="storage may have become slower"):
        warnings = m.record({**entry(5, 0.1, 1000), "persist_s": 4.0, "total_s": 4.4})
    assert [w.split(" took")[0] for w in warnings] == ["writing it (slowest rank)", "committing it"]
    assert "4.0x the median of the last 4 full saves (1.00s) for 1.00x the bytes" in warnings[0]
    # short saves are noise whatever the ratio
    assert m.record({**entry(6, 0.1, 1000), "persist_s": 0.4, "total_s": 0.45}) == []


def _scrape(url: str, pattern: str, expect=None, timeout: float = 90) -> list[str]:
    """The lines of Ray's metrics page matching ``pattern``, once one exists and, given
    ``expect`` (a value or a predicate on it), once the first one's value meets it: Ray
    exports on a period, so a page read just after a save may still show the one before."""
    ok = expect if callable(expect) else (lambda v: expect is None or v == expect)
    deadline = time.time() + timeout
    lines: list[str] = []
    while time.time() < deadline:
        try:
            body = urllib.request.urlopen(url, timeout=10).read().decode()
        except OSError:
            body = ""
        lines = [ln for ln in body.splitlines() if re.search(pattern, ln) and not ln.startswith("#")]
        if lines and ok(_value(lines[0])):
            return lines
        time.sleep(2)
    raise AssertionError(f"no metric matching {pattern!r} with the expected value at {url} "
                         f"after {timeout}s; last seen: {lines}")


def _value(line: str) -> float:
    return float(line.rsplit(" ", 1)[1])


def test_saves_are_published_as_ray_metrics(group2, local_root, metrics_url):
    m = manager(local_root, {"actor": group2}, config={"job_name": "metrics-test",
                                                       "verify_after_save": True})
    try:
        for step in (1, 2):
            train(group2, [step])
            m.update(step=step, metrics={"reward": 0.1 * step})
            m.save_checkpoint().wait(120)
        m.wait_for_cleanup(120)
        assert ray.get(m.coordinator.wait_verifications.remote(120), timeout=180)
        stats = m.checkpoint_stats
        assert [s["ok"] for s in stats] == [True, True] and stats[-1]["anomalies"] == []
    finally:
        m.close(120)
    job = 'job="metrics-test"'
    _scrape(metrics_url, rf"^ray_raycheckpoint_last_committed_step\{{.*{job}", 2.0)
    _scrape(metrics_url, rf"^ray_raycheckpoint_stall_seconds\{{.*{job}", lambda v: 0 < v < 30)
    _scrape(metrics_url, rf"^ray_raycheckpoint_checkpoint_bytes\{{.*{job}", stats[-1]["bytes"])
    _scrape(metrics_url, rf"^ray_raycheckpoint_saves_total\{{.*outcome=\"committed\".*{job}"
                         rf"|^ray_raycheckpoint_saves_total\{{.*{job}.*outcome=\"committed\"", 2.0)
    _scrape(metrics_url, rf"^ray_raycheckpoint_bytes_written_total\{{.*{job}",
            sum(s["bytes"] for s in stats))
    assert _scrape(metrics_url, r"^ray_raycheckpoint_persist_seconds\{")
    _scrape(metrics_url, rf"^ray_raycheckpoint_last_verified_step\{{.*{job}", 2.0)
    assert _scrape(metrics_url, rf"^ray_raycheckpoint_verifications_total\{{.*{job}")
