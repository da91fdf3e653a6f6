"""The legs of :mod:`bench.gpu_check`, each a function of its own process or of ranks it
spawns (torch.distributed over TCP on 127.0.0.1; no Ray).

They run the library's own save and load path, below the Ray actors: the rank's
:class:`~raycheckpoint._internal.staging.HostStager` (pinned buffers and a copy stream on
a GPU), :func:`~raycheckpoint._internal.dcp.save.save_state` through the
:class:`~raycheckpoint._internal.dcp.writer.HashingStorageWriter` (checksums while
writing), and :func:`~raycheckpoint._internal.dcp.load.load_verified` through the
:class:`~raycheckpoint._internal.dcp.reader.VerifyingStorageReader` (every file checked
against the checksums the save recorded).
"""

from __future__ import annotations

import os
import signal
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

GB = 1 << 30
# the one-process saves run without a process group, as meant
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def init_group(rank: int, world: int, port: int, device: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=120))


def fsdp_model(device: str, world: int, width: int, layers: int = 4):
    """A stack of linear layers sharded with FSDP2 over ``world`` ranks, with AdamW after
    one step (so the optimizer state exists); the same initial weights on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    mesh = init_device_mesh(device, (world,))
    for layer in net:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    optim = torch.optim.AdamW(net.parameters(), lr=1e-3)
    return net, optim


def train_step(net, optim, device: str, width: int, seed: int) -> None:
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(8, width, device=device, generator=g)
    net(x).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def state_of(net, optim) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from raycheckpoint.state_dict_cache import optimizer_state_dict

    return {"model": get_model_state_dict(net), "optim": optimizer_state_dict(net, optim)}


def full_state(net, optim) -> dict[str, torch.Tensor]:
    """Every tensor of the model and optimizer, unsharded, on cpu, by flat name."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from raycheckpoint.state_dict_cache import optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    flat, _ = flatten_state_dict({"model": get_model_state_dict(net, options=opts),
                                  "optim": optimizer_state_dict(net, optim, options=opts)})
    return {k: v.detach().cpu().clone() for k, v in flat.items() if isinstance(v, torch.Tensor)}


def save(stager, state: dict[str, Any], root: str, name: str, group: Any = None) -> dict:
    """Stage ``state`` (host copy) and write it as DCP with checksums; the files' entries."""
    from raycheckpoint._internal.dcp.save import save_state
    from raycheckpoint._internal.dcp.shard_plan import ShardPlan
    from raycheckpoint._internal.dcp.writer import HashingStorageWriter
    from raycheckpoint.storage import Storage

    storage = Storage(root, checksum=checksum())
    staged = stager.stage("full", state)
    plan = ShardPlan()
    writer = HashingStorageWriter(storage, name, plan)
    save_state(staged, writer, plan, group)
    return {e.path: e for e in writer.written}


def load(state: dict[str, Any], root: str, name: str, expected: dict) -> None:
    from raycheckpoint._internal.dcp.load import load_verified
    from raycheckpoint._internal.dcp.reader import VerifyingStorageReader
    from raycheckpoint.storage import Storage

    load_verified(state, VerifyingStorageReader(Storage(root, checksum=checksum()), name, expected))


def checksum() -> str:
    try:
        import blake3  # noqa: F401
    except ImportError:  # the format's other algorithm: same checks, one core
        return "sha256"
    return "blake3"


def gather_entries(entries: dict, world: int) -> dict:
    """Every rank's written files (each rank writes its own; the manifest lists them all)."""
    if world == 1:
        return entries
    out: list[Any] = [None] * world
    dist.all_gather_object(out, entries)
    return {k: v for part in out for k, v in part.items()}


# ---- leg: save on the device, load on the device and on cpu, bitwise ------------------------


def roundtrip(device: str, port: int, root: str, width: int) -> dict[str, Any]:
    from raycheckpoint._internal.staging import HostStager

    init_group(0, 1, port, device)
    try:
        net, optim = fsdp_model(device, 1, width)
        train_step(net, optim, device, width, 1)
        stager = HostStager("gpu-check rank 0")
        # the checkpoint's own collectives on a gloo group, as the workers run them
        ckpt_group = dist.new_group(backend="gloo")
        entries = save(stager, state_of(net, optim), root, "ckpt", ckpt_group)
        expected = full_state(net, optim)
        torch.save({"entries": entries, "full": expected}, os.path.join(root, "saved.pt"))
        # back onto the device, into a fresh model (other weights until loaded)
        net2, optim2 = fsdp_model(device, 1, width)
        train_step(net2, optim2, device, width, 99)
        load(state_of(net2, optim2), root, "ckpt", entries)
        got = full_state(net2, optim2)
        same_device = _equal(expected, got)
        # onto the cpu: plain tensors, device-free on storage
        cpu = {"model": {k[len("model."):]: torch.empty_like(v) for k, v in expected.items()
                         if k.startswith("model.")}}
        load(cpu, root, "ckpt", entries)
        same_cpu = _equal({k: v for k, v in expected.items() if k.startswith("model.")},
                          {f"model.{k}": v for k, v in cpu["model"].items()})
        return {"device_bitwise": same_device, "cpu_bitwise": same_cpu,
                "pinned": stager.pin_memory, "files": len(entries),
                "bytes": sum(e.size for e in entries.values())}
    finally:
        dist.destroy_process_group()


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def reshard_rank(rank: int, world: int, port: int, root: str, width: int, out: dict) -> None:
    """One of ``world`` CPU ranks loading the one-rank checkpoint, resharded."""
    init_group(rank, world, port, "cpu")
    try:
        saved = torch.load(os.path.join(root, "saved.pt"), weights_only=False)
        net, optim = fsdp_model("cpu", world, width)
        train_step(net, optim, "cpu", width, 99)
        load(state_of(net, optim), root, "ckpt", saved["entries"])
        got = full_state(net, optim)
        if rank == 0:
            out["reshard_bitwise"] = _equal(saved["full"], got)
        # and the reverse trip: a checkpoint these cpu ranks save, for the device to load
        from raycheckpoint._internal.staging import HostStager

        train_step(net, optim, "cpu", width, 7)
        entries = gather_entries(save(HostStager(f"cpu rank {rank}"), state_of(net, optim), root,
                                      "ckpt_cpu", dist.new_group(backend="gloo")), world)
        full = full_state(net, optim)
        if rank == 0:
            torch.save({"entries": entries, "full": full}, os.path.join(root, "saved_cpu.pt"))
    finally:
        dist.destroy_process_group()


def load_on_device(device: str, port: int, root: str, width: int) -> dict[str, Any]:
    """The 2 cpu ranks' checkpoint loaded by one rank on the device (2 -> 1): bitwise."""
    init_group(0, 1, port, device)
    try:
        saved = torch.load(os.path.join(root, "saved_cpu.pt"), weights_only=False)
        net, optim = fsdp_model(device, 1, width)
        train_step(net, optim, device, width, 99)
        load(state_of(net, optim), root, "ckpt_cpu", saved["entries"])
        return {"cpu_to_device_bitwise": _equal(saved["full"], full_state(net, optim))}
    finally:
        dist.destroy_process_group()


# ---- leg: stall against the pinned copy limit -------------------------------------------------


def flat_state(device: str, nbytes: int, pieces: int = 32) -> dict[str, Any]:
    """``nbytes`` of fp32 tensors on ``device``, shaped as a model + AdamW state (1 : 2)."""
    per = max(1, nbytes // 4 // (3 * pieces))
    model = {f"w{i}": torch.randn(per, device=device) for i in range(pieces)}
    optim = {f"w{i}": {"exp_avg": torch.randn(per, device=device),
                       "exp_avg_sq": torch.rand(per, device=device)} for i in range(pieces)}
    return {"model": model, "optim": optim}


def copy_limit_s(device: str, nbytes: int) -> float:
    """Seconds of one device-to-host copy of ``nbytes`` into pinned memory (cpu: a memcpy)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=device == "cuda")
    best = float("inf")
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return best


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def stall(device: str, nbytes: int, matmul: int) -> dict[str, float]:
    """The blocked time of a save in default mode (plan + copy) and in overlap mode (plan
    only; the copy runs on its stream while a matmul loop keeps the device busy)."""
    import threading

    from raycheckpoint._internal.staging import HostStager

    state = flat_state(device, nbytes)
    stager = HostStager("gpu-check")
    stager.stage("full", state)  # buffers allocated and touched: steady state from here
    default = []
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        stager.stage("full", state)
        default.append(time.perf_counter() - t0)
    a = torch.randn(matmul, matmul, device=device)

    def steps(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            a @ a
        sync(device)
        return time.perf_counter() - t0

    alone = steps(8) / 8
    overlap, beside = [], []
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        _, copies, ready = stager.plan("full", state)
        blocked = time.perf_counter() - t0
        copier = threading.Thread(target=stager.copy, args=(copies, ready))
        copier.start()
        n, t1 = 0, time.perf_counter()
        while copier.is_alive() or n < 2:
            a @ a
            n += 1
            if device == "cuda":  # this stream only: the copy's stream runs on beside it
                torch.cuda.current_stream().synchronize()
        copier.join()
        beside.append((time.perf_counter() - t1) / n)
        overlap.append(blocked)
    return {"default_s": sorted(default)[1], "overlap_s": sorted(overlap)[1],
            "matmul_alone_s": alone, "matmul_beside_copy_s": sorted(beside)[1]}


# ---- leg: memory over many saves ------------------------------------------------------------


def memory_over_saves(device: str, nbytes: int, saves: int, root: str) -> dict[str, Any]:
    import shutil

    from raycheckpoint._internal.staging import HostStager

    state = flat_state(device, nbytes)
    stager = HostStager("gpu-check")
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
    # the staging buffers' pinned pages also count in the resident set (checked on every device)
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is not None and "reserved_bytes.current" in stats():
        out["pinned_reserved"] = int(stats()["reserved_bytes.current"])
    return out


# ---- leg: a saving process killed -------------------------------------------------------------


def saving_forever(device: str, nbytes: int, root: str, marker: str) -> None:
    """Save again and again (the process is killed while it does)."""
    from raycheckpoint._internal.staging import HostStager

    state = flat_state(device, nbytes)
    stager = HostStager("gpu-check")
    i = 0
    while True:
        save(stager, state, root, f"k{i}")
        if i == 0:
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
        i += 1


def kill_while_saving(ctx, device: str, nbytes: int, root: str) -> dict[str, Any]:
    marker = os.path.join(root, "saving")
    free_before = torch.cuda.mem_get_info()[0] if device == "cuda" else None
    proc = ctx.Process(target=saving_forever, args=(device, nbytes, root, marker))
    proc.start()
    deadline = time.time() + 240
    while not os.path.exists(marker):
        if time.time() > deadline or not proc.is_alive():
            proc.kill()
            raise RuntimeError("the saving process never completed a first save")
        time.sleep(0.05)
    time.sleep(0.3)  # into a later save
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=60)
    out: dict[str, Any] = {"killed": proc.exitcode == -signal.SIGKILL}
    if device == "cuda":
        deadline, free_after = time.time() + 30, 0
        while time.time() < deadline:
            free_after = torch.cuda.mem_get_info()[0]
            if free_after >= free_before - 64 * 2**20:
                break
            time.sleep(0.2)
        out.update(gpu_free_before=free_before, gpu_free_after=free_after,
                   gpu_memory_returned=free_after >= free_before - 64 * 2**20)
    return out
