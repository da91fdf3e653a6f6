"""Checkpoint statistics as Ray metrics, and a warning when they grow abnormally.

:class:`CheckpointMetrics` is fed every finished save's ``checkpoint_stats`` entry by the
manager.  It sets Ray metrics (``ray.util.metrics``; Ray's Prometheus endpoint exports
them with a ``ray_`` prefix):

=====================================  ======  ====================================
``raycheckpoint_stall_seconds``        gauge   training blocked by the last save
``raycheckpoint_persist_seconds``      gauge   slowest rank's write of the last save
``raycheckpoint_commit_seconds``       gauge   save start -> committed
``raycheckpoint_checkpoint_bytes``     gauge   size of the last committed checkpoint
``raycheckpoint_last_committed_step``  gauge   step of the last committed checkpoint
``raycheckpoint_bytes_written``        counter bytes committed
``raycheckpoint_saves``                counter saves, by ``outcome`` (committed / failed)
``raycheckpoint_save_failures``        counter failed saves
``raycheckpoint_anomalies``            counter abnormal saves, by ``what`` (stall / size /
                                               persist / commit)
``raycheckpoint_last_verified_step``   gauge   step of the newest checkpoint that passed
                                               background verification
``raycheckpoint_verifications``        counter background verifications, by ``outcome``
``raycheckpoint_replication_pending``  gauge   a tiered job's checkpoints waiting for the
                                               durable tier, as of the last commit
=====================================  ======  ====================================

tagged with ``job`` (``CheckpointConfig.job_name``) and ``kind`` (full / light).

Abnormal growth (a save's stall above ``stall_warn_factor`` times, its size above
``size_warn_factor`` times, or its persist or commit time above ``slow_warn_factor``
times, the median of the previous ``anomaly_window`` committed saves of the same kind)
is logged, warned once per save, and listed in the entry's ``anomalies``: a sudden size
jump often means weights saved in a wider dtype than intended; a rising stall means host
memory or storage has become the bottleneck; rising persist and commit times with a
steady size mean the storage itself has become slower.
"""

from __future__ import annotations

import logging
import statistics
import warnings
from collections import defaultdict, deque
from typing import Any

logger = logging.getLogger(__name__)

MIN_HISTORY = 3
MIN_STALL_S = 0.05  # below this a stall is noise, whatever the ratio
MIN_SLOW_S = 0.5  # below this a persist or commit time is noise, whatever the ratio


class CheckpointMetrics:
    def __init__(self, job: str, *, window: int = 10, stall_warn_factor: float = 3.0,
                 size_warn_factor: float = 1.5, slow_warn_factor: float = 3.0,
                 publish: bool = True) -> None:
        self.job = job
        self.stall_warn_factor = stall_warn_factor
        self.size_warn_factor = size_warn_factor
        self.slow_warn_factor = slow_warn_factor
        self._history: dict[str, deque[dict[str, Any]]] = defaultdict(lambda: deque(maxlen=window))
        self._m: dict[str, Any] = {}
        if publish:
            self._m = _ray_metrics()

    def _tags(self, kind: str, **more: str) -> dict[str, str]:
        return {"job": self.job, "kind": kind, **more}

    def record(self, entry: dict[str, Any]) -> list[str]:
        """Publish one finished save; return (and warn about) its anomalies."""
        kind = entry.get("kind", "full")
        anomalies: list[str] = []
        if entry.get("ok"):
            anomalies = self._anomalies(kind, entry)
            self._history[kind].append(entry)
        if self._m:
            self._publish(kind, entry)
            for what, _ in anomalies:
                self._m["anomalies"].inc(1, tags=self._tags(kind, what=what))
        anomalies_text = [text for _, text in anomalies]
        for a in anomalies_text:
            logger.warning("checkpoint %s: %s", entry.get("name"), a)
            warnings.warn(f"checkpoint {entry.get('name')}: {a}", RuntimeWarning, stacklevel=3)
        return anomalies_text

    def verified(self, result: dict[str, Any]) -> None:
        """Publish one background verification's result."""
        if not self._m:
            return
        self._m["verifications"].inc(1, tags={"job": self.job,
                                              "outcome": "ok" if result.get("ok") else "failed"})
        if result.get("ok"):
            self._m["verified_step"].set(float(result.get("step") or 0), tags={"job": self.job})

    def _anomalies(self, kind: str, entry: dict[str, Any]) -> list[tuple[str, str]]:
        """(what, message) for each figure of ``entry`` far above its recent median."""
        history = list(self._history[kind])
        if len(history) < MIN_HISTORY:
            return []
        out: list[tuple[str, str]] = []
        stall = entry.get("stall_s") or 0.0
        median_stall = statistics.median(h.get("stall_s") or 0.0 for h in history)
        if stall > MIN_STALL_S and median_stall > 0 and stall > self.stall_warn_factor * median_stall:
            out.append(("stall", f"training was blocked {stall:.3f}s, {stall / median_stall:.1f}x the median "
                       f"of the last {len(history)} {kind} saves ({median_stall:.3f}s): host memory "
                       "or storage may have become the bottleneck"))
        size = entry.get("bytes") or 0
        median_size = statistics.median(h.get("bytes") or 0 for h in history)
        if median_size > 0 and size > self.size_warn_factor * median_size:
            out.append(("size", f"checkpoint size {size / 1e6:.1f} MB is "
                       f"{size / median_size:.2f}x the median of the last {len(history)} {kind} "
                       f"saves ({median_size / 1e6:.1f} MB): were "
                       "weights saved in a wider dtype (e.g. full precision) than before?"))
        for what, key, label in (("persist", "persist_s", "writing it (slowest rank)"),
                                 ("commit", "total_s", "committing it")):
            took = entry.get(key) or 0.0
            median = statistics.median(h.get(key) or 0.0 for h in history)
            if took > MIN_SLOW_S and median > 0 and took > self.slow_warn_factor * median:
                ratio = size / median_size if median_size > 0 else 1.0
                out.append((what, f"{label} took {took:.2f}s, {took / median:.1f}x the median of "
                            f"the last {len(history)} {kind} saves ({median:.2f}s) for "
                            f"{ratio:.2f}x the bytes: storage may have become slower"))
        return out

    def _publish(self, kind: str, entry: dict[str, Any]) -> None:
        m, tags = self._m, self._tags(kind)
        m["stall"].set(float(entry.get("stall_s") or 0.0), tags=tags)
        if entry.get("ok"):
            m["saves"].inc(1, tags=self._tags(kind, outcome="committed"))
            m["persist"].set(float(entry.get("persist_s") or 0.0), tags=tags)
            m["commit"].set(float(entry.get("total_s") or 0.0), tags=tags)
            m["bytes"].set(float(entry.get("bytes") or 0), tags=tags)
            if entry.get("bytes"):
                m["written"].inc(float(entry["bytes"]), tags=tags)
            m["step"].set(float(entry.get("step") or 0), tags={"job": self.job})
            if "replication_pending" in entry:
                m["pending"].set(float(entry["replication_pending"]), tags={"job": self.job})
        else:
            m["saves"].inc(1, tags=self._tags(kind, outcome="failed"))
            m["failures"].inc(1, tags=tags)


def _ray_metrics() -> dict[str, Any]:
    from ray.util.metrics import Counter, Gauge

    keys = ("job", "kind")
    return {
        "stall": Gauge("raycheckpoint_stall_seconds", "Training blocked by the last save (s)",
                       tag_keys=keys),
        "persist": Gauge("raycheckpoint_persist_seconds",
                         "Slowest rank's background write of the last save (s)", tag_keys=keys),
        "commit": Gauge("raycheckpoint_commit_seconds", "Save start to committed (s)", tag_keys=keys),
        "bytes": Gauge("raycheckpoint_checkpoint_bytes", "Size of the last committed checkpoint",
                       tag_keys=keys),
        "step": Gauge("raycheckpoint_last_committed_step", "Step of the last committed checkpoint",
                      tag_keys=("job",)),
        "written": Counter("raycheckpoint_bytes_written", "Bytes of committed checkpoints",
                           tag_keys=keys),
        "saves": Counter("raycheckpoint_saves", "Finished saves by outcome",
                         tag_keys=(*keys, "outcome")),
        "failures": Counter("raycheckpoint_save_failures", "Saves that failed (not committed)",
                            tag_keys=keys),
        "anomalies": Counter("raycheckpoint_anomalies",
                             "Saves with a figure far above its recent median, by what",
                             tag_keys=(*keys, "what")),
        "pending": Gauge("raycheckpoint_replication_pending",
                         "Checkpoints waiting for the durable tier (tiered jobs)",
                         tag_keys=("job",)),
        "verified_step": Gauge("raycheckpoint_last_verified_step",
                               "Step of the newest checkpoint that passed verification",
                               tag_keys=("job",)),
        "verifications": Counter("raycheckpoint_verifications",
                                 "Background verifications by outcome",
                                 tag_keys=("job", "outcome")),
    }
