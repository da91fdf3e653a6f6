"""What a point of :mod:`bench.save_latency` measures after its rounds of saves and loads:
training steps beside a background persist (:func:`step_overhead`), and every method's
last checkpoint loaded into fewer ranks (:func:`reshard_loads`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

import ray

from bench._harness import (
    TIMEOUT_S,
    BenchStorage,
    Where,
    _cleaned_up,
    _group,
    _kill,
    _manager,
    _max,
    _median,
    _rotated,
    _settle,
)
from bench._ranks import RESHARDS
from raycheckpoint import CheckpointManager


def _perturb(group: list[Any]) -> None:
    ray.get([w.perturb.remote() for w in group], timeout=TIMEOUT_S)


def _train_step(group: list[Any], batch: int, seq: int) -> float:
    return _max([w.train_step.remote(batch, seq) for w in group])


def _copy_waits(group: list[Any]) -> list[float]:
    """What each rank's optimizer has waited for overlapped copies so far (s)."""
    return [s["copy_wait_s"] for s in
            ray.get([w.ckpt_status.remote() for w in group], timeout=TIMEOUT_S)]


def _waited_since(group: list[Any], before: list[float]) -> float:
    """The most any rank's optimizer waited for an overlapped copy since ``before``."""
    return max(b - a for a, b in zip(before, _copy_waits(group), strict=True))


@contextlib.contextmanager
def _config(manager: CheckpointManager, **changes: Any):
    """The manager's config with ``changes`` (read at each save), restored after."""
    plain = manager.config
    manager.config = dataclasses.replace(plain, **changes)
    try:
        yield
    finally:
        manager.config = plain


def step_overhead(group: list[Any], manager: CheckpointManager, storage: BenchStorage,
                  batch: int, seq: int, saves: int = 5) -> dict[str, Any]:
    """A training step alone, and while a background persist runs: raycheckpoint's, and
    (side by side) DCP ``async_save``'s with a kept stager.  Each save follows a step
    alone, so the steps alone and beside a persist face the machine as it is then (it is
    shared: measured in blocks, five steps alone before the saves and five after, the two
    sides drifted apart by more than the effect).

    Then the same saves with ``overlap_copy``: training is blocked for the snapshot call
    plus what the next optimizer step waits for the copy (``overlap_stall_s``), and that
    first step (its forward/backward beside the copy) is timed against a step alone.
    Last, saves riding on a training step (:func:`ride_save`), without and with
    ``overlap_copy`` (``ride_stall_s``, ``ride_overlap_stall_s``).
    """
    def step() -> float:
        return _train_step(group, batch, seq)

    step()  # warms up
    alone: list[float] = []
    during: list[float] = []
    first_after_save: list[float] = []  # the step right after a save, beside its persist
    during_dcp: list[float] = []
    overlap_stall: list[float] = []
    overlap_first_step: list[float] = []
    for i in range(saves):
        alone.append(step())
        manager.update(step=manager.global_step + 1)
        handle = manager.save_checkpoint()
        while not handle.done():
            during.append(step())
            if len(first_after_save) <= i:
                first_after_save.append(during[-1])
        handle.wait(TIMEOUT_S)
        _cleaned_up(manager)
        url = storage.url(f"dcp_async_stager/steps{i}")
        alone.append(step())
        ray.get([w.start_async.remote(url) for w in group], timeout=TIMEOUT_S)
        while not all(ray.get([w.async_done.remote() for w in group], timeout=TIMEOUT_S)):
            during_dcp.append(step())
        ray.get([w.wait_async.remote() for w in group], timeout=TIMEOUT_S)
        storage.remove(f"dcp_async_stager/steps{i}")
    with _config(manager, overlap_copy=True):
        for _ in range(saves):
            manager.update(step=manager.global_step + 1)
            before = _copy_waits(group)
            handle = manager.save_checkpoint()
            overlap_first_step.append(step())
            overlap_stall.append(handle.stall_s + _waited_since(group, before))
            handle.wait(TIMEOUT_S)
            _cleaned_up(manager)
    ride = {"ride_stall_s": [], "ride_overlap_stall_s": []}
    phases: dict[str, dict[str, float]] = {}
    for key, overlap in (("ride_stall_s", False), ("ride_overlap_stall_s", True)):
        with _config(manager, overlap_copy=overlap):
            saved = [ride_save(group, manager, batch, seq) for _ in range(saves)]
        ride[key] = [stall for stall, _ in saved]
        phases[key.removesuffix("_s") + "_breakdown_ms"] = _phase_medians([b for _, b in saved])
    a, b, c = _median(alone), _median(during), _median(during_dcp)
    f = _median(overlap_first_step)
    return {"step_s": a, "step_during_persist_s": b, "steps_during_persist": len(during),
            "slowdown": (b / a - 1) if a and b else None,
            "step_during_dcp_async_s": c, "dcp_async_slowdown": (c / a - 1) if a and c else None,
            "first_step_after_save_s": _median(first_after_save),
            "overlap_stall_s": _median(overlap_stall), "overlap_first_step_s": f,
            "overlap_first_step_slowdown": (f / a - 1) if a and f else None,
            **{k: _median(v) for k, v in ride.items()}, **phases, "batch": batch, "seq": seq}


def _phase_medians(breakdowns: list[dict[str, float]]) -> dict[str, float]:
    """Each phase's median over the saves that have it (ms; the breakdown's other
    entries, the rank and whether it rode on its step, are left out)."""
    def timed(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    names = {p for b in breakdowns for p, v in b.items() if timed(v)}
    return {p: _median([b[p] for b in breakdowns if timed(b.get(p))]) for p in sorted(names)}


def ride_save(group: list[Any], manager: CheckpointManager, batch: int, seq: int
              ) -> tuple[float, dict[str, float]]:
    """One save riding on a training step (``step_save``, the step's calls, ``snapshot()``,
    ``step()``), as a job makes it: the time it blocked training (``stall_s``: the request,
    the slowest rank's snapshot right after its update, the driver's finish) plus what the
    next optimizer step waited for an overlapped copy, and where the blocked time went
    (the handle's ``breakdown``, ms)."""
    number = manager.global_step + 1
    before = _copy_waits(group)
    riding = manager.step_save(number)
    if riding is None:
        raise RuntimeError("the bench's manager saves every step (save_full_interval=1): "
                           f"step_save({number}) asked for no save")
    training = [w.train_step.remote(batch, seq) for w in group]
    riding.snapshot()
    ray.get(training, timeout=TIMEOUT_S)
    handle = manager.step(number)
    if handle is None or handle.name != f"step_{number:08d}":
        raise RuntimeError(f"step({number}) did not complete the save begun with the step")
    _train_step(group, batch, seq)  # its optimizer step waits for what a copy has left
    waited = _waited_since(group, before)
    handle.wait(TIMEOUT_S)
    _cleaned_up(manager)
    return handle.stall_s + waited, dict(handle.breakdown)


def reshard_loads(ranks: int, d: int, storage: BenchStorage, methods: tuple[str, ...],
                  ray_name: str | None, urls: dict[str, str], full_digest: str, *,
                  repeat: int = 1, where: Where = Where(),
                  log=print) -> dict[str, list[float]]:
    """Each method's last checkpoint loaded into ``ranks`` ranks, ``repeat`` times.

    The methods take turns in rounds (the first one rotating, as for the saves); every
    load starts from perturbed state, a settled disk and evicted files, and is checked
    against the saved state.
    """
    group, placement = _group(ranks, d, storage, where)
    out: dict[str, list[float]] = {m: [] for m in methods if RESHARDS[m]}
    manager = _manager(storage, group)
    try:
        for rnd in range(repeat):
            for method in (m for m in _rotated(methods, rnd) if m in out):
                _perturb(group)
                _settle(group, storage)
                storage.drop_cache(method)
                t0 = time.perf_counter()
                if method == "raycheckpoint":
                    manager.load_checkpoint(ray_name)
                    out[method].append(time.perf_counter() - t0)
                else:
                    out[method].append(_max([w.load.remote(method, urls[method]) for w in group]))
                got = ray.get([w.full_digest.remote() for w in group], timeout=TIMEOUT_S)[0]
                if got != full_digest:
                    raise RuntimeError(f"{method}: the resharded load into {ranks} ranks did not "
                                       "restore the saved state")
            log(f"   reshard load -> {ranks} ranks, round {rnd + 1}: " + ", ".join(
                f"{m} {v[-1]:.3f} s" for m, v in out.items()))
    finally:
        manager.close(TIMEOUT_S)
        _kill(group, placement)
    return out
