"""The correctness legs of :mod:`bench.gpu_check` (round trip, reshard, kill) and what the
legs share; each leg is a function of its own process or of ranks it spawns
(torch.distributed over TCP on 127.0.0.1; no Ray).  The timing legs are in
:mod:`bench._gpu_perf`.

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
FAIL_ENV = "RAYCHECKPOINT_GPU_CHECK_FAIL"  # legs to fail (or hang) on purpose: LEG[:hang],...
# the one-process saves run without a process group, as meant
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def maybe_fail(leg: str) -> None:
    """Fail (or hang in) ``leg`` where the run was asked to (``gpu_check --fail``), here in
    the leg's own process, as a real failure would."""
    for item in filter(None, os.environ.get(FAIL_ENV, "").split(",")):
        name, _, how = item.partition(":")
        if name == leg:
            if how == "hang":
                time.sleep(3600)
            raise RuntimeError(f"leg {leg} failed on purpose (gpu_check --fail {item})")


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


def host_stager(who: str):
    """A rank's :class:`~raycheckpoint._internal.staging.HostStager` (its host buffers)."""
    from raycheckpoint._internal.staging import HostStager

    return HostStager(who)


def bounded_buffer(nbytes: int, *, pin: bool):
    """The host buffer of ``checkpoint.host_buffer_bytes``
    (:class:`~raycheckpoint._internal.bounded_write.BoundedBuffer`)."""
    from raycheckpoint._internal.bounded_write import BoundedBuffer

    return BoundedBuffer(nbytes, pin=pin)


def save(stager, state: dict[str, Any], root: str, name: str, group: Any = None) -> dict:
    """Stage ``state`` (host copy) and write it as DCP with checksums; the files' entries."""
    return write(stager.stage("full", state), root, name, group)


def write(state: dict[str, Any], root: str, name: str, group: Any = None,
          bounded: Any = None) -> dict:
    """Write ``state`` as DCP with checksums: staged, or with ``bounded`` (a
    :func:`bounded_buffer`, begun) its live tensors through that buffer; the files' entries."""
    from raycheckpoint._internal.bounded_write import live_state
    from raycheckpoint._internal.dcp.save import save_state
    from raycheckpoint._internal.dcp.shard_plan import ShardPlan
    from raycheckpoint._internal.dcp.writer import HashingStorageWriter
    from raycheckpoint.storage import Storage

    plan = ShardPlan()
    writer = HashingStorageWriter(Storage(root, checksum=checksum()), name, plan, None, bounded)
    save_state(state if bounded is None else live_state(state), writer, plan, group)
    return {e.path: e for e in writer.written}


def load(state: dict[str, Any], root: str, name: str, expected: dict) -> None:
    from raycheckpoint._internal.dcp.load import load_verified
    from raycheckpoint._internal.dcp.reader import VerifyingStorageReader
    from raycheckpoint.storage import Storage

    load_verified(state, VerifyingStorageReader(Storage(root, checksum=checksum()), name, expected))


def checksum() -> str:
    """BLAKE3 where this Python has it, else the format's other algorithm (same checks,
    one core)."""
    from raycheckpoint.integrity import digest

    return "blake3" if digest.available("blake3") else "sha256"


def gather_entries(entries: dict, world: int) -> dict:
    """Every rank's written files (each rank writes its own; the manifest lists them all)."""
    if world == 1:
        return entries
    out: list[Any] = [None] * world
    dist.all_gather_object(out, entries)
    return {k: v for part in out for k, v in part.items()}


# ---- leg: save on the device, load on the device and on cpu, bitwise ------------------------


def roundtrip(device: str, port: int, root: str, width: int) -> dict[str, Any]:
    init_group(0, 1, port, device)
    try:
        net, optim = fsdp_model(device, 1, width)
        train_step(net, optim, device, width, 1)
        stager = host_stager("gpu-check rank 0")
        # the checkpoint's own collectives on a gloo group, as the workers run them
        ckpt_group = dist.new_group(backend="gloo")
        pinned_before = pinned_allocator_bytes() if device == "cuda" else None
        entries = save(stager, state_of(net, optim), root, "ckpt", ckpt_group)
        host = staged_host_memory(stager)
        if pinned_before is not None and pinned_before.get("bytes") is not None:
            after = pinned_allocator_bytes()
            host["pinned_allocator_bytes"] = after["bytes"] - pinned_before["bytes"]
            host["pinned_allocator_key"] = after["key"]
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
                "pinned": host["all_pinned"], **host, "files": len(entries),
                "bytes": sum(e.size for e in entries.values())}
    finally:
        dist.destroy_process_group()


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def reshard_rank(rank: int, world: int, port: int, root: str, width: int, out: dict) -> None:
    """One of ``world`` CPU ranks loading the one-rank checkpoint, resharded."""
    try:
        maybe_fail("reshard")
    except RuntimeError as e:
        out["error"] = str(e)
        raise
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
        train_step(net, optim, "cpu", width, 7)
        entries = gather_entries(save(host_stager(f"cpu rank {rank}"), state_of(net, optim), root,
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


# ---- leg: a saving process killed -------------------------------------------------------------


def host_state(device: str, nbytes: int, pieces: int = 32, seed: int = 0,
               portable: bool = False) -> dict[str, Any]:
    """``nbytes`` of fp32 tensors on ``device``, shaped as a model + AdamW state (1 : 2);
    drawn on the device (fast at 16 GB), or with ``portable`` on the cpu and moved, so
    that any device's state can be drawn again on the cpu to compare."""
    where = "cpu" if portable else device
    g = torch.Generator(device=where).manual_seed(seed)
    per = max(1, nbytes // 4 // (3 * pieces))

    def t() -> torch.Tensor:
        return torch.randn(per, generator=g, device=where).to(device)

    return {"model": {f"w{i}": t() for i in range(pieces)},
            "optim": {f"w{i}": {"exp_avg": t(), "exp_avg_sq": t().abs()} for i in range(pieces)}}


def staged_host_memory(stager) -> dict[str, Any]:
    """What a stager's buffers hold: bytes, and whether every one is pinned (``is_pinned``
    on the staged tensors themselves, not the stager's intent)."""
    tensors = [t for staging in stager.staging.values() for t in staging.tensors()]
    return {"staged_bytes": sum(t.numel() * t.element_size() for t in tensors),
            "all_pinned": bool(tensors) and all(t.is_pinned() for t in tensors),
            "pinned_bytes": getattr(stager, "pinned_bytes", None)}


def pinned_allocator_bytes() -> dict[str, Any]:
    """What torch's caching host (pinned) allocator holds, with the key torch reports it
    under (``allocated_bytes.current`` today; ``reserved_bytes.current`` in some releases);
    None where this torch reports neither."""
    stats = torch.cuda.host_memory_stats()
    for key in ("allocated_bytes.current", "reserved_bytes.current"):
        if key in stats:
            return {"bytes": int(stats[key]), "key": key}
    return {"bytes": None, "key": None, "keys": sorted(stats)[:20]}


def saving_forever(device: str, nbytes: int, root: str) -> None:
    """Save again and again, a changed state each time, each save's files recorded in
    ``k<i>.done`` once written (as a commit would), until killed."""
    import json

    state = host_state(device, nbytes, portable=True)
    stager = host_stager("gpu-check")
    i = 0
    while True:
        for v in state["model"].values():
            v.fill_(float(i))
        entries = save(stager, state, root, f"k{i}")
        tmp = os.path.join(root, f"k{i}.done.tmp")
        with open(tmp, "w") as f:
            json.dump({p: e.to_dict() for p, e in entries.items()}, f)
        os.replace(tmp, os.path.join(root, f"k{i}.done"))
        i += 1


def kill_while_saving(device: str, nbytes: int, root: str) -> dict[str, Any]:
    """SIGKILL a saving process during a save; then every save it finished must load,
    verified, bitwise, and (GPU) its device memory must be free again."""
    import json
    import multiprocessing as mp

    from raycheckpoint.storage.spec import FileEntry

    free_before = torch.cuda.mem_get_info()[0] if device == "cuda" else None
    proc = mp.get_context("spawn").Process(target=saving_forever, args=(device, nbytes, root))
    proc.start()
    try:
        deadline = time.time() + 90
        while not os.path.exists(os.path.join(root, "k1.done")):
            if time.time() > deadline or not proc.is_alive():
                raise RuntimeError("the saving process never finished two saves")
            time.sleep(0.02)
        time.sleep(0.05)  # into a later save
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=60)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(30)
    out: dict[str, Any] = {"killed": proc.exitcode == -signal.SIGKILL}
    done = sorted(int(n[1:-5]) for n in os.listdir(root) if n.endswith(".done"))
    bitwise = []
    for i in done:  # every finished save: verified against its record, the state it had
        with open(os.path.join(root, f"k{i}.done")) as f:
            entries = {p: FileEntry.from_dict(e) for p, e in json.load(f).items()}
        want = host_state("cpu", nbytes, portable=True)
        for v in want["model"].values():
            v.fill_(float(i))
        got = {k: {n: torch.empty_like(t) for n, t in part.items()} if k == "model" else
               {n: {m: torch.empty_like(t) for m, t in d.items()} for n, d in part.items()}
               for k, part in want.items()}
        load(got, root, f"k{i}", entries)
        bitwise.append(all(torch.equal(got["model"][n], want["model"][n]) for n in want["model"])
                       and all(torch.equal(got["optim"][n][m], want["optim"][n][m])
                               for n in want["optim"] for m in want["optim"][n]))
    out.update(finished_saves=len(done), finished_saves_bitwise=bool(done) and all(bitwise),
               interrupted_save_files=len(os.listdir(os.path.join(root, f"k{done[-1] + 1}")))
               if done and os.path.isdir(os.path.join(root, f"k{done[-1] + 1}")) else 0)
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
