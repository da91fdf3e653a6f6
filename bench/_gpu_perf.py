"""The timing legs of :mod:`bench.gpu_check`: the stall of a save against the pinned
device-to-host copy limit, and memory over many saves.  Each runs in a process of its own.

The stall is what training is blocked for.  In default mode that is the whole staging
(the stager's plan and the copy).  In overlap mode (``checkpoint.overlap_copy``) it is
the plan, then, after a training step's work (a loop of matmuls on the training stream
lasting about twice the copy), the wait the optimizer step's hook pays for what is not
yet copied: the same wait as ``ckpt_wait_copy``.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from typing import Any

import torch

from bench._gpu_legs import (
    bounded_buffer,
    host_stager,
    host_state,
    load,
    pinned_allocator_bytes,
    save,
    staged_host_memory,
    write,
)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_limit_s(device: str, nbytes: int) -> float:
    """Seconds of one device-to-host copy of ``nbytes`` into pinned memory (cpu: a memcpy),
    the best of 3 after a first copy that faults the destination in."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=device == "cuda")
    dst.copy_(src)
    best = float("inf")
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return best


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def staged_stalls(stager, state: dict[str, Any], device: str, rounds: int = 3) -> list[float]:
    """Seconds of each of ``rounds`` stagings of ``state`` (the default mode's stall), after
    a first one that allocates and touches the buffers: steady state."""
    stager.stage("full", state)
    out = []
    for _ in range(rounds):
        sync(device)
        t0 = time.perf_counter()
        stager.stage("full", state)
        out.append(time.perf_counter() - t0)
    return out


def stall(device: str, nbytes: int, rounds: int = 3) -> dict[str, Any]:
    """Blocked time of a save in default mode and in overlap mode, beside the copy limit."""
    limit = copy_limit_s(device, nbytes)
    state = host_state(device, nbytes)
    stager = host_stager("gpu-check")
    default = staged_stalls(stager, state, device, rounds)

    n = 8192 if device == "cuda" else 256
    a = torch.randn(n, n, device=device)

    def matmuls(k: int) -> float:
        t0 = time.perf_counter()
        for _ in range(k):
            a @ a
        sync(device)
        return time.perf_counter() - t0

    matmuls(3)  # warm-up: cuBLAS's start-up and the first kernels are not the baseline
    alone = matmuls(8) / 8
    k = max(2, int(2 * limit / alone) + 1)  # a training step of about twice the copy

    plan_s, wait_s, beside = [], [], []
    for _ in range(rounds):
        sync(device)
        t0 = time.perf_counter()
        _, copies, ready = stager.plan("full", state)
        plan_s.append(time.perf_counter() - t0)
        copier = threading.Thread(target=stager.copy, args=(copies, ready))
        copier.start()
        t1 = time.perf_counter()
        for _ in range(k):  # forward and backward: the copy's stream runs beside them
            a @ a
        if device == "cuda":
            torch.cuda.current_stream().synchronize()
        beside.append((time.perf_counter() - t1) / k)
        t2 = time.perf_counter()  # the optimizer step's hook: wait for what is not copied
        copier.join()
        wait_s.append(time.perf_counter() - t2)
    overlap = [p + w for p, w in zip(plan_s, wait_s, strict=True)]
    host = staged_host_memory(stager)
    return {"limit_s": limit, "default_s": _median(default), "overlap_s": _median(overlap),
            "overlap_plan_s": _median(plan_s), "overlap_wait_s": _median(wait_s),
            "step_matmuls": k, "matmul_alone_s": alone, "matmul_beside_copy_s": _median(beside),
            "staged_bytes": host["staged_bytes"], "pinned_bytes": host["pinned_bytes"]}


def memory_over_saves(device: str, nbytes: int, saves: int, root: str) -> dict[str, Any]:
    state = host_state(device, nbytes)
    stager = host_stager("gpu-check")
    samples = []
    for i in range(saves):
        for v in state["model"].values():
            v.add_(1.0)
        save(stager, state, root, f"s{i % 2}")
        shutil.rmtree(os.path.join(root, f"s{(i + 1) % 2}"), ignore_errors=True)
        samples.append({"rss": _rss(), **(_cuda_memory() if device == "cuda" else {})})
    return {"samples": samples}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _cuda_memory() -> dict[str, int]:
    out = {"gpu_reserved": torch.cuda.memory_reserved(), "gpu_allocated": torch.cuda.memory_allocated()}
    pinned = pinned_allocator_bytes()
    if pinned["bytes"] is not None:
        out["pinned_allocated"] = pinned["bytes"]
    return out


def budget_stall(device: str, nbytes: int, budget: int, root: str) -> dict[str, Any]:
    """A save of ``nbytes`` through a host buffer of ``budget`` bytes
    (``checkpoint.host_buffer_bytes``): training's stall (until the buffer is released),
    the host memory it held, and the files loaded back verified, bitwise; beside the stall
    of a staged save of the same state."""
    state = host_state(device, nbytes)
    staged = staged_stalls(host_stager("gpu-check"), state, device)
    bounded = bounded_buffer(budget, pin=device == "cuda")
    stalls, entries = [], {}
    for i in range(2):  # the first allocates the buffer
        ready = None
        if device == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        sync(device)
        t0 = time.perf_counter()
        bounded.begin(ready)
        entries = write(state, root, f"b{i}", bounded=bounded)
        if not bounded.released.wait(600):
            raise RuntimeError("the bounded save never released its buffer")
        stalls.append(time.perf_counter() - t0)
    got = host_state("cpu", nbytes, seed=1)
    load(got, root, "b1", entries)
    want = {k: v.cpu() for k, v in state["model"].items()}
    return {"budget_bytes": budget, "stall_s": stalls[-1], "staged_stall_s": _median(staged),
            "host_bytes": bounded.host_bytes, "peak_chunk_bytes": bounded.peak,
            "chunks": bounded.chunks, "pinned": bounded.pinned,
            "bitwise": all(torch.equal(got["model"][k], want[k]) for k in want)}
