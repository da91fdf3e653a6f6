"""Soak: 200 consecutive saves (light and full, tags, best-N) with retention on.

Storage must stay bounded by the retention rules, host memory and thread counts of the
driver, the workers and the coordinator must stay flat, and every kept checkpoint must
verify at the end.  The figures are printed at the end of the pytest run and written to
``soak-<backend>.json`` beside the root.  Marked ``soak``; .ci/run runs it.
"""

from __future__ import annotations

import json
import os
import threading
import time

import psutil
import pytest
import ray

from raycheckpoint import Storage
from raycheckpoint.admin import verify
from tests.helpers import REPORTS, manager, train

SAVES = 200
RULES = {"keep_last_n": 3, "keep_last_n_light": 2, "keep_best_n": 2, "best_metric": "reward",
         "best_mode": "max"}
TAG_EVERY = 50
MB = 1024 * 1024


def _pid(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


LANES = 3  # a saver's background threads: persist, copy beside training, early write


def _own_threads(self) -> tuple[int, int]:
    """On an actor: its live raycheckpoint-* threads that are not a rank's saver lanes
    (kept for the process's life: ``_internal/lanes.py``), and those lanes."""
    saver = getattr(self, "_ckpt_saver", None)
    lanes = set() if saver is None else {lane.name for lane in saver.lanes.all()}
    names = [t.name for t in threading.enumerate() if t.name.startswith("raycheckpoint-")
             and t.name != "raycheckpoint-exit-watch"]
    return sum(n not in lanes for n in names), sum(n in lanes for n in names)


def _settled_own_threads(actor, at_most: int, timeout_s: float = 30.0) -> dict[str, int]:
    """The actor's live raycheckpoint-* threads (commit, lease; a rank's saver lanes
    counted apart: those of a saver replaced, its worker set up again for another root,
    end), once settled.

    A save's commit thread sends the commit broadcast after ``wait`` returns, so it may
    still be alive for a moment; a leak never settles.  The exit watchdog
    (``_internal/exit.py``: one per process, for the process's life) is not a save's.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        n, lanes = ray.get(actor.__ray_call__.remote(_own_threads), timeout=60)
        if (n <= at_most and lanes <= LANES) or time.monotonic() > deadline:
            return {"per_save": n, "lanes": lanes}
        time.sleep(0.2)


def _sample(procs: dict[str, psutil.Process]) -> dict[str, dict[str, float]]:
    return {name: {"rss_mb": p.memory_info().rss / MB, "threads": p.num_threads()}
            for name, p in procs.items()}


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("backend", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_200_saves_stay_bounded_and_flat(backend, group2, local_root, request, tmp_path):
    root, options = (local_root, {}) if backend == "local" else request.getfixturevalue("s3_root")
    m = manager(root, {"actor": group2}, options, config=RULES)
    procs = {"driver": psutil.Process(os.getpid()), "coordinator": psutil.Process(_pid(m.coordinator))}
    procs.update({f"worker{r}": psutil.Process(_pid(w)) for r, w in enumerate(group2)})
    storage = Storage(root, options)
    # kept at most: the rules' counts, the newest full, one per tag (tags are never collected)
    bound = RULES["keep_last_n"] + RULES["keep_last_n_light"] + RULES["keep_best_n"] + 1
    samples, own, counts, sizes, save_s = {}, {}, [], [], []
    try:
        for i in range(1, SAVES + 1):
            if i % 10 == 0:
                train(group2, [i])
            kind = "full" if i % 4 == 0 else "light"
            tag = f"m{i}" if i % TAG_EVERY == 0 else None
            reward = ((i * 7919) % 1000) / 1000.0
            m.update(step=i, metrics={"reward": reward, "loss": 1.0 - reward})
            t0 = time.perf_counter()
            m.save_checkpoint(tag=tag, kind=kind).wait(300)
            save_s.append(time.perf_counter() - t0)
            if i in (20, SAVES):
                own[i] = {"coordinator": _settled_own_threads(m.coordinator, 0)}
                # a worker's persists run on its saver's lanes, started once
                own[i].update({f"worker{r}": _settled_own_threads(w, 0)
                               for r, w in enumerate(group2)})
                samples[i] = _sample(procs)
            if i % 25 == 0:
                m.wait_for_cleanup(300)  # retention runs after each commit
                steps = [n for n in storage.list_dir("") if n.startswith("step_")]
                counts.append(len(steps))
                sizes.append(sum(storage.list_files("").values()))
                assert len(steps) <= bound + i // TAG_EVERY, (i, steps)
        catalog = m.catalog()
        stats = m.checkpoint_stats
    finally:
        m.close(300)
    assert len(stats) == SAVES and all(s["ok"] for s in stats)
    kept = [c["name"] for c in catalog["checkpoints"]]
    assert len(kept) <= bound + SAVES // TAG_EVERY
    assert set(catalog["tags"]) == {f"m{i}" for i in range(TAG_EVERY, SAVES + 1, TAG_EVERY)}
    doc = verify(root, options)
    assert doc["ok"] and not doc["problems"], doc
    assert sorted(c["name"] for c in doc["checkpoints"]) == sorted(kept)
    growth = {name: {"rss_mb": samples[SAVES][name]["rss_mb"] - samples[20][name]["rss_mb"],
                     "threads": samples[SAVES][name]["threads"] - samples[20][name]["threads"]}
              for name in procs}
    for name, g in growth.items():
        assert g["rss_mb"] < 64, (name, growth)     # flat: no per-save leak
        # Ray starts some of its own threads lazily (gRPC, the actor's call pool), so
        # the OS count may rise by a few once; a thread left behind per save would
        # add 180 here
        assert g["threads"] <= 8, (name, growth)
    # none of this library's threads (commit, persist) outlive their save; a rank's
    # three lanes (persist, copy, early write) are all it keeps
    assert own[SAVES]["coordinator"]["per_save"] == 0 and all(
        own[SAVES][f"worker{r}"]["per_save"] == 0 and own[SAVES][f"worker{r}"]["lanes"] <= LANES
        for r in range(len(group2))), own
    assert threading.active_count() < 50
    report = {"backend": backend, "saves": SAVES, "kept_at_end": len(kept),
              "step_dirs_every_25_saves": counts, "bytes_every_25_saves": sizes,
              "memory_and_threads_at_save_20": samples[20],
              f"memory_and_threads_at_save_{SAVES}": samples[SAVES], "growth": growth,
              "raycheckpoint_threads": own,
              "save_s_median": sorted(save_s)[len(save_s) // 2], "save_s_max": max(save_s)}
    (tmp_path / f"soak-{backend}.json").write_text(json.dumps(report, indent=1))
    REPORTS.append(f"soak ({backend}): " + json.dumps(report, indent=1))
