"""What every benchmark run stands on: its storage, its rank groups, and small helpers.

:class:`BenchStorage` is where a run writes (a directory, any fsspec URI, or ``moto://``:
a local S3 server in a process of its own, :class:`MotoProcess`); :class:`Where` says
where a point's ranks run; :func:`_group` / :func:`_kill` start and end a point's FSDP2
group (:mod:`bench._ranks`), :func:`_manager` its raycheckpoint manager.  Used by
:mod:`bench.save_latency` and :mod:`bench.release_ab`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any

import fsspec
import ray

from bench._ranks import BenchRank, drop_page_cache
from raycheckpoint import CheckpointConfig, CheckpointManager
from workers.group import Placement, create_worker_group, place_ranks

TIMEOUT_S = 3600.0
SETTLE_IDLE_S = 0.5
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 64MB, 1GB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from e
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need positive integers: {text!r}")
    return values


def _sizes(text: str) -> list[int]:
    return [parse_bytes(v) for v in text.split(",") if v.strip()]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _spread(values: list[float]) -> list[float] | None:
    return [min(values), max(values)] if values else None


# ---- storage ---------------------------------------------------------------------------------


class MotoProcess:
    """moto's S3 server in a process of its own, on 127.0.0.1, as an S3 endpoint would be.

    Run as threads of the benchmark's driver (``ThreadedMotoServer``), every request it
    served took the driver's GIL: the driver, which times the saves and dispatches the
    training steps, then waited behind the uploads it was measuring.

    It runs at ``nice`` (default 19, the lowest priority): a cluster's object store
    spends other machines' CPU, while this one shares the ranks' cores, and parsing an
    upload costs it about twice the CPU the ranks spend sending it (2 x 64 MB: 1.27 s
    against 0.60 s).  At the ranks' priority it slowed a training step beside an S3
    persist by 140%, at nice 19 by 64% (alternated, 12 steps each), with the same durable
    time (1.30 s against 1.34 s): a save alone still gets the whole server.
    """

    def __init__(self, timeout_s: float = 60.0, nice: int = 19) -> None:
        from workers.group import free_port

        port = free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        self._proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                       "-p", str(port)], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
        try:  # lowering a process's priority is always allowed; absolute, as `renice` is
            os.setpriority(os.PRIO_PROCESS, self._proc.pid,
                           max(nice, os.getpriority(os.PRIO_PROCESS, self._proc.pid)))
        except OSError:  # it exited already: the wait below reports it
            pass
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                    return
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto's S3 server did not start on port {port} "
                                       f"(exit code {self._proc.returncode})") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)


class BenchStorage:
    """The storage a run writes to: a directory, any fsspec URI, or ``moto://`` (a local S3)."""

    def __init__(self, uri: str | None, options: dict[str, Any]) -> None:
        self._server = None
        self._tmp = None
        self.options = dict(options)
        if uri is None:
            self._tmp = tempfile.mkdtemp(prefix="rc-bench-")
            uri = self._tmp
        elif uri.startswith("moto://"):
            self._server = MotoProcess()
            self.options = {"endpoint_url": self._server.endpoint, "key": uuid.uuid4().hex[:20],
                            "secret": uuid.uuid4().hex, **self.options}
            os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
            fs = fsspec.filesystem("s3", **self.options)
            fs.mkdir("bench")
            uri = "s3://bench"
        self.root = f"{uri.rstrip('/')}/run-{uuid.uuid4().hex[:8]}"
        self.fs, self.path = fsspec.core.url_to_fs(self.root, **self.options)
        self.local = self.fs.protocol in ("file", ("file", "local"))
        self.kind = "local" if self.local else ("s3 (moto)" if self._server else str(self.fs.protocol))

    def url(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def drop_cache(self, rel: str = "") -> None:
        if self.local:
            drop_page_cache(os.path.join(self.path, rel))

    def remove(self, rel: str) -> None:
        try:
            self.fs.rm(f"{self.path}/{rel}", recursive=True)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.remove("")
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
        if self._server is not None:
            self._server.stop()
            self._server = None


# ---- one point -------------------------------------------------------------------------------


def _max(refs: list[Any]) -> float:
    return max(ray.get(refs, timeout=TIMEOUT_S))


@dataclass(frozen=True)
class Where:
    """Where a point's ranks run and hold their state.

    ``resources`` per rank (e.g. ``{"GPU": 1}``) place the ranks in a placement group (on
    a cluster, across nodes: the autoscaler starts them); without, on this node.
    ``device="cuda"`` keeps the state on each rank's GPU (one per rank).
    """

    device: str = "cpu"
    resources: dict[str, float] | None = None
    strategy: str = "PACK"

    def describe(self) -> str:
        placed = (f", ranks placed by {json.dumps(self.resources)} ({self.strategy})"
                  if self.resources else "")
        return f"state on {self.device}{placed}"


def _group(ranks: int, d: int, storage: BenchStorage, where: Where) -> tuple[list[Any], Placement]:
    if where.resources:
        print(f"   placing {ranks} ranks, each {json.dumps(where.resources)} ({where.strategy}); "
              "on a cluster the autoscaler may be starting nodes", flush=True)
    placement = place_ranks(ranks, resources=where.resources, strategy=where.strategy,
                            timeout_s=TIMEOUT_S)
    try:
        group = create_worker_group(BenchRank, role="actor", world_size=ranks, timeout_s=TIMEOUT_S,
                                    placement=placement, d=d, storage_options=storage.options,
                                    device=where.device)
    except BaseException:
        placement.remove()
        raise
    return group, placement


def _kill(group: list[Any], placement: Placement) -> None:
    for w in group:
        ray.kill(w)
    placement.remove()


def _manager(storage: BenchStorage, group: list[Any]) -> CheckpointManager:
    cfg = CheckpointConfig(save_dir=storage.url("raycheckpoint"), storage_options=storage.options,
                           keep_last_n=1, publish_metrics=False, commit_timeout_s=TIMEOUT_S,
                           rpc_timeout_s=TIMEOUT_S, job_name="bench",
                           # every step saves, for the saves riding on a step (step_save);
                           # the other saves are made with save_checkpoint
                           save_full_interval=1, save_on_preemption=False)
    return CheckpointManager(cfg, {"actor": group})


def _cleaned_up(manager: CheckpointManager) -> None:
    """Wait for the clean-up that follows our last commit (retention deleting the
    checkpoint before it, ``keep_last_n=1``), which runs after ``handle.wait()`` returns.

    A job's next save comes steps later; here the next timed thing (another method's save,
    our load, a step alone, our next save) came right after the commit and ran beside the
    deletes, or, for our next save, waited for them: ``begin`` takes the commit lock the
    clean-up holds. Back to back on S3 (moto) an overlapped save blocked training for
    60 ms, 13 ms once the clean-up (49-77 ms) was waited for.
    """
    manager.wait_for_cleanup(TIMEOUT_S)


def _rotated(methods: tuple[str, ...], rnd: int) -> tuple[str, ...]:
    """The methods in round ``rnd``'s order: each round starts one method later."""
    k = rnd % len(methods)
    return methods[k:] + methods[:k]


def _settle(group: list[Any], storage: BenchStorage) -> None:
    """Write back every dirty page on the ranks' machines before a timed save or load.

    Without it, what one method left in the page cache (verl's ``torch.save`` never
    fsyncs) is written back during the next method's save or load, and the limits,
    measured first, would face an idle disk that no method's save does.  Then the
    machine is left idle for a moment: right after the sync, a save's stall here was
    ~30 ms longer and a write + fsync of 2 x 60 MB 3x slower than half a second later.
    """
    if storage.local:
        ray.get([w.settle.remote() for w in group], timeout=TIMEOUT_S)
        time.sleep(SETTLE_IDLE_S)
