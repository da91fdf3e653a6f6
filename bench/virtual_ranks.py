"""How commit coordination grows with ranks: many virtual ranks per process, real coordinator.

    python -m bench.save_latency --virtual-ranks 8,64,256 [--virtual-hosts 4] [--shard-bytes 64KiB]

A few host actors each play many ranks.  Per save, every virtual rank writes its own
shard file through :class:`~raycheckpoint.storage.Storage` (streamed sha256, fsync on
local disk) and sends its own ``report`` to the real
:class:`~raycheckpoint.protocol.coordinator.CheckpointCoordinator` actor, exactly as a worker's
persist thread does; the coordinator then runs its real barrier, merges the reports
into the manifest and commits (trainer_state, version, manifest, COMMITTED, LATEST,
catalog, retention).  The shards hold bytes, not tensors: this measures coordination,
not serialization, and each committed checkpoint is verified (every file hashed
against the merged manifest) before it counts.

Reported per rank count (medians over ``--repeat`` saves after a warm-up):

* ``commit_overhead_s``: from the last report's arrival (every host's report calls
  returned) until ``wait`` returns committed: the barrier wake-up, the manifest merge
  and the commit writes, as the driver sees them;
* ``commit_s``: the coordinator's own time from all reports in to committed;
* ``save_s``: ``begin`` to committed, including the virtual ranks' writes.
"""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray

from raycheckpoint import CheckpointConfig, verify_checkpoint
from raycheckpoint.protocol import coordinator_actor as checkpoint_coordinator
from raycheckpoint.storage import StorageSpec

TIMEOUT_S = 1800.0


@ray.remote(num_cpus=0)
class VirtualRankHost:
    """Plays ``ranks`` ranks of one role: writes each one's shard and reports it."""

    def __init__(self, spec: StorageSpec, ranks: list[int], shard_bytes: int, threads: int = 8) -> None:
        self.storage = spec.open()
        self.ranks = list(ranks)
        self.shards = {r: (bytes([r % 251]) * 64 + b"\0" * shard_bytes)[:shard_bytes] for r in ranks}
        self.pool = ThreadPoolExecutor(max_workers=threads)
        self._lock = threading.Lock()

    def ready(self) -> int:
        return len(self.ranks)

    def persist(self, save_id: str, step_dir: str, role: str, coordinator: Any) -> float:
        """Write and report every rank's shard; returns when the coordinator has them all."""
        def one(rank: int) -> None:
            t0 = time.perf_counter()
            entry = self.storage.write_bytes(f"{step_dir}/{role}/__{rank}_0.distcp", self.shards[rank])
            ray.get(coordinator.report.remote(save_id, role, rank, [entry.to_dict()], None,
                                              time.perf_counter() - t0), timeout=TIMEOUT_S)

        for f in [self.pool.submit(one, r) for r in self.ranks]:
            f.result(timeout=TIMEOUT_S)
        return time.time()


def run_virtual(counts: list[int], storage: Any, *, hosts: int = 4, shard_bytes: int = 65536,
                repeat: int = 3, role: str = "actor", log=print) -> dict[str, Any]:
    """One coordinator per rank count; returns ``{"virtual_ranks": {N: {...}}, "config": ...}``."""
    out: dict[str, Any] = {"virtual_ranks": {}, "config": {
        "hosts": hosts, "shard_bytes": shard_bytes, "repeat": repeat, "storage": storage.kind}}
    for n in counts:
        spec = StorageSpec(storage.url(f"virtual-{n}"), dict(storage.options))
        config = CheckpointConfig(save_dir=spec.uri, storage_options=spec.options, keep_last_n=2,
                                  publish_metrics=False, lease=False, commit_timeout_s=TIMEOUT_S)
        coordinator = checkpoint_coordinator.start(spec, config, None)
        per_host = [list(range(h, n, hosts)) for h in range(min(hosts, n))]
        actors = [VirtualRankHost.remote(spec, ranks, shard_bytes) for ranks in per_host]
        ray.get([a.ready.remote() for a in actors], timeout=TIMEOUT_S)
        rows: list[dict[str, float]] = []
        try:
            for i in range(repeat + 1):  # the first save warms up
                t0 = time.time()
                begun = ray.get(coordinator.begin.remote(
                    step=i + 1, kind="full", tag=None, metrics={}, trainer_state={},
                    expected=[(role, r) for r in range(n)], world_sizes={role: n}),
                    timeout=TIMEOUT_S)
                coordinator.snapshotted.remote(begun["save_id"])
                reported = max(ray.get([a.persist.remote(begun["save_id"], begun["name"], role,
                                                         coordinator) for a in actors],
                                       timeout=TIMEOUT_S))
                result = ray.get(coordinator.wait.remote(begun["save_id"], TIMEOUT_S),
                                 timeout=TIMEOUT_S)
                committed = time.time()
                t1 = time.perf_counter()
                summary = verify_checkpoint(spec.open(), begun["name"])
                verify_s = time.perf_counter() - t1
                if summary.get("files", n) < n:
                    raise RuntimeError(f"{begun['name']}: {summary} lists fewer than {n} shards")
                if i:
                    rows.append({"commit_overhead_s": committed - reported,
                                 "commit_s": result["commit_s"], "save_s": committed - t0,
                                 "verify_s": verify_s, "files": result["files"]})
        finally:
            for a in actors:
                ray.kill(a)
            ray.kill(coordinator)
            storage.remove(f"virtual-{n}")
        row = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        row["spread"] = {k: [min(r[k] for r in rows), max(r[k] for r in rows)]
                         for k in ("commit_overhead_s", "commit_s")}
        out["virtual_ranks"][str(n)] = row
        log(f"   {n:>4} virtual ranks: commit overhead {row['commit_overhead_s']:.3f} s "
            f"(coordinator {row['commit_s']:.3f} s), save {row['save_s']:.3f} s, "
            f"{int(row['files'])} files")
    ns = sorted(out["virtual_ranks"], key=int)
    if len(ns) > 1:
        a, b = out["virtual_ranks"][ns[0]], out["virtual_ranks"][ns[-1]]
        out["growth"] = {"ranks": [int(ns[0]), int(ns[-1])],
                         "ranks_ratio": int(ns[-1]) / int(ns[0]),
                         "commit_overhead_ratio": b["commit_overhead_s"] / a["commit_overhead_s"],
                         "commit_s_ratio": b["commit_s"] / a["commit_s"]}
    return out


def virtual_table(results: dict[str, Any]) -> str:
    c = results["config"]
    lines = [f"virtual ranks on {c['storage']}: {c['hosts']} host processes, "
             f"{c['shard_bytes']} B per shard, median of {c['repeat']}",
             f"{'ranks':>6}{'commit overhead s':>19}{'coordinator commit s':>22}{'save s':>9}"
             f"{'verify s':>10}"]
    for n, row in sorted(results["virtual_ranks"].items(), key=lambda kv: int(kv[0])):
        lines.append(f"{n:>6}{row['commit_overhead_s']:>19.3f}{row['commit_s']:>22.3f}"
                     f"{row['save_s']:>9.3f}{row['verify_s']:>10.3f}")
    g = results.get("growth")
    if g:
        lines.append(f"growth {g['ranks'][0]} -> {g['ranks'][1]} ranks (x{g['ranks_ratio']:.0f}): "
                     f"commit overhead x{g['commit_overhead_ratio']:.2f}, "
                     f"coordinator commit x{g['commit_s_ratio']:.2f}")
    return "\n".join(lines)
