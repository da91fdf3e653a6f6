"""BenchRank: one FSDP2 rank holding model + AdamW state of a chosen size, saved seven ways.

Every method saves the same in-memory state of the same rank, so the methods differ
only in how they save it:

* ``raycheckpoint``: through the :class:`~raycheckpoint.worker.CheckpointableWorker`
  hooks (the driver runs the :class:`~raycheckpoint.CheckpointManager`);
* ``verl``: verl's own ``FSDPCheckpointManager`` (``save_checkpoint`` / ``load_checkpoint``;
  needs verl, installed in ``.venv-verl``: see :mod:`bench._verl`), and the same save
  followed by the fsync it skips;
* ``verl_sync``: an imitation of verl's save for environments without verl: each rank
  ``torch.save``s its model and optimizer shards, then a barrier;
* ``rank0_gather``: gather the full state dict to rank 0, which ``torch.save``s it;
* ``dcp_sync``: ``torch.distributed.checkpoint.save``;
* ``dcp_async``: ``async_save`` in thread mode (a new default stager per save);
* ``dcp_async_stager``: ``async_save`` with one ``DefaultStager`` kept for the job, whose
  staging buffers are reused from save to save.

Times are measured on every rank from a common barrier; the driver takes the maximum.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from typing import Any

import ray
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from bench._limits import Limits, _fs
from raycheckpoint.worker import (
    CheckpointableWorker,
    StateDictCache,
    local_tensors,
    optimizer_state_dict,
)
from workers.group import init_process_group

METHODS = ("raycheckpoint", "verl", "verl_sync", "rank0_gather", "dcp_sync", "dcp_async",
           "dcp_async_stager")
# which methods can load a checkpoint into a different number of ranks
RESHARDS = {"raycheckpoint": True, "verl": False, "verl_sync": False, "rank0_gather": True, "dcp_sync": True,
            "dcp_async": True, "dcp_async_stager": True}
N_LAYERS = 16
VOCAB = 4096
STATE_BYTES_PER_PARAM = 12  # fp32 weight + AdamW exp_avg + exp_avg_sq


def model_dims(total_bytes: int, *, n_layers: int = N_LAYERS, vocab: int = VOCAB) -> int:
    """The width ``d`` whose model (12 d^2 per layer + embeddings and head) holds ``total_bytes``."""
    params = total_bytes / STATE_BYTES_PER_PARAM
    a, b = 12 * n_layers, 2 * vocab
    d = (-b + math.sqrt(b * b + 4 * a * params)) / (2 * a)
    return max(16, round(d / 16) * 16)


class _Block(nn.Module):
    """A decoder layer's tensors: attention projections and MLP (12 d^2 weights)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        x = x + self.proj(self.qkv(self.ln1(x))[..., :d])
        return x + self.down(nn.functional.gelu(self.up(self.ln2(x))))


class BenchLM(nn.Module):
    def __init__(self, d: int, n_layers: int, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def digest(state: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for path, t in sorted(local_tensors(state).items()):
        h.update(path.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def drop_page_cache(path: str) -> None:
    """Evict ``path``'s files from the page cache, so a load reads the disk (local only)."""
    for dirpath, _, names in os.walk(path):
        for name in names:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class _BenchRank(Limits, CheckpointableWorker):
    def __init__(self, *, role: str, rank: int, world_size: int, master_addr: str,
                 master_port: int, timeout_s: float = 600.0, d: int, n_layers: int = N_LAYERS,
                 vocab: int = VOCAB, storage_options: dict[str, Any] | None = None,
                 device: str = "cpu") -> None:
        self.role, self.rank, self.world_size = role, rank, world_size
        self.options = dict(storage_options or {})
        self.device = torch.device(device)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(f"rank {rank}: --device cuda, but this rank sees no GPU "
                                   "(give each rank one: --worker-resources '{\"GPU\": 1}')")
            # Ray hands each rank its GPU through CUDA_VISIBLE_DEVICES: it is device 0
            torch.cuda.set_device(self.device.index or 0)
            self.device = torch.device("cuda", torch.cuda.current_device())
        init_process_group(rank=rank, world_size=world_size, master_addr=master_addr,
                           master_port=master_port, timeout_s=timeout_s,
                           backend="cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo")
        with torch.device("meta"):
            self.net = BenchLM(d, n_layers, vocab)
        mesh = init_device_mesh(self.device.type, (world_size,))
        for block in self.net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.net, mesh=mesh)
        self.net.to_empty(device=self.device)
        g = torch.Generator().manual_seed(1234 + rank)
        with torch.no_grad():
            for p in self.net.parameters():
                p.to_local().normal_(0.0, 0.02, generator=g)
        # DCP's collectives get a group of their own, as torch recommends for async_save: its
        # background thread must not interleave with training's collectives on the default one
        self._dcp_pg = dist.new_group(backend="gloo")
        self.optim = torch.optim.AdamW(self.net.parameters(), lr=1e-4)
        self.ckpt_guard(self.optim)  # lets the bench measure checkpoint.overlap_copy
        self._state_dicts = StateDictCache(self.net, self.optim)  # what a worker would use
        self.vocab = vocab
        self.train_step(1, 8)  # AdamW state exists and is not zero
        self._stager = None
        self._bg = None
        self._verl_manager = None

    def ready(self) -> dict[str, Any]:
        return {"rank": self.rank, "bytes": self.state_bytes(),
                "tensors": len(local_tensors(self.state())), "device": str(self.device),
                "node_id": ray.get_runtime_context().get_node_id(),
                "placement_group": ray.get_runtime_context().get_placement_group_id()}

    # ---- training and state -------------------------------------------------------------

    def train_step(self, batch: int, seq: int) -> float:
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(self.rank)
        tokens = torch.randint(0, self.vocab, (batch, seq + 1), generator=g).to(self.device)
        logits = self.net(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, self.vocab), tokens[:, 1:].reshape(-1))
        self.optim.zero_grad(set_to_none=True)
        loss.backward()
        self.optim.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def state(self) -> dict[str, Any]:
        return {"model": get_model_state_dict(self.net),
                "optim": optimizer_state_dict(self.net, self.optim)}

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in local_tensors(self.state()).values())

    def local_digest(self) -> str:
        return digest(self.state())

    def full_digest(self) -> str | None:
        """sha256 of the whole (gathered) model and optimizer state, on rank 0."""
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = {"model": get_model_state_dict(self.net, options=opts),
                "optim": optimizer_state_dict(self.net, self.optim, options=opts)}
        return digest(full) if self.rank == 0 else None

    def perturb(self) -> None:
        """Change the state, so a load that does nothing cannot look like a correct one."""
        with torch.no_grad():
            for t in local_tensors(self.state()).values():
                if t.is_floating_point():
                    t.add_(1.0)

    # ---- CheckpointableWorker hooks ------------------------------------------------------

    def ckpt_state_dict(self, kind: str) -> dict[str, Any]:
        return self._state_dicts.state_dict(kind)

    def ckpt_load_state_dict(self, state: dict[str, Any], kind: str) -> None:
        self._state_dicts.load_state_dict(state)  # what a worker would use

    # ---- the other methods --------------------------------------------------------------------

    def _writer(self, url: str) -> Any:
        _, path, local = _fs(url, self.options)
        if local:
            return dcp.FileSystemWriter(path)
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
        return FsspecWriter(url, **self.options)

    def _reader(self, url: str) -> Any:
        _, path, local = _fs(url, self.options)
        if local:
            return dcp.FileSystemReader(path)
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
        return FsspecReader(url, **self.options)

    def _torch_save(self, obj: Any, url: str) -> None:
        fs, path, _ = _fs(url, self.options)
        fs.makedirs(os.path.dirname(path), exist_ok=True)
        with fs.open(path, "wb") as f:
            torch.save(obj, f)

    def _torch_load(self, url: str) -> Any:
        fs, path, _ = _fs(url, self.options)
        with fs.open(path, "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=False)

    def _stager_for_job(self) -> Any:
        """One DefaultStager kept for the job: its staging memory is reused between saves."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(
                use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
                use_non_blocking_copy=cuda))
        return self._stager

    def _verl(self) -> Any:
        """verl's own checkpoint manager around this rank's model and optimizer, built once."""
        if self._verl_manager is None:
            from bench._verl import VerlManager

            self._verl_manager = VerlManager(self.net, self.optim)
        return self._verl_manager

    def save(self, method: str, url: str, step: int = 0) -> dict[str, Any]:
        """Save with ``method``: ``stall_s`` (until training may go on) and ``durable_s``."""
        if method == "verl":
            return self._verl().save(_fs(url, self.options)[1], step)
        dist.barrier()
        t0 = time.perf_counter()
        r, ws = self.rank, self.world_size
        if method == "verl_sync":
            state = self.state()
            self._torch_save(state["model"], f"{url}/model_world_size_{ws}_rank_{r}.pt")
            self._torch_save(state["optim"], f"{url}/optim_world_size_{ws}_rank_{r}.pt")
            dist.barrier()
            stall = durable = time.perf_counter() - t0
        elif method == "rank0_gather":
            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            full = {"model": get_model_state_dict(self.net, options=opts),
                    "optim": optimizer_state_dict(self.net, self.optim, options=opts)}
            if r == 0:
                self._torch_save(full, f"{url}/full.pt")
            del full
            dist.barrier()
            stall = durable = time.perf_counter() - t0
        elif method == "dcp_sync":
            dcp.save(self.state(), storage_writer=self._writer(url), process_group=self._dcp_pg)
            stall = durable = time.perf_counter() - t0
        elif method in ("dcp_async", "dcp_async_stager"):
            stager = self._stager_for_job() if method == "dcp_async_stager" else None
            fut = dcp.async_save(self.state(), storage_writer=self._writer(url), async_stager=stager,
                                 process_group=self._dcp_pg)
            stall = time.perf_counter() - t0
            fut.result()
            durable = time.perf_counter() - t0
        else:
            raise ValueError(f"unknown method {method!r} (raycheckpoint runs from the driver)")
        return {"stall_s": stall, "durable_s": durable}

    def load(self, method: str, url: str) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        r, ws = self.rank, self.world_size
        if method == "verl":
            self._verl().load(_fs(url, self.options)[1])
        elif method == "verl_sync":
            model = self._torch_load(f"{url}/model_world_size_{ws}_rank_{r}.pt")
            optim = self._torch_load(f"{url}/optim_world_size_{ws}_rank_{r}.pt")
            set_model_state_dict(self.net, model)
            set_optimizer_state_dict(self.net, self.optim, optim)
        elif method == "rank0_gather":
            full = self._torch_load(f"{url}/full.pt") if r == 0 else {"model": {}, "optim": {}}
            opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(self.net, full["model"], options=opts)
            set_optimizer_state_dict(self.net, self.optim, full["optim"], options=opts)
        elif method in ("dcp_sync", "dcp_async", "dcp_async_stager"):
            state = self.state()
            dcp.load(state, storage_reader=self._reader(url), process_group=self._dcp_pg)
            self.ckpt_load_state_dict(state, "full")
        else:
            raise ValueError(f"unknown method {method!r}")
        dist.barrier()
        return time.perf_counter() - t0

    def start_async(self, url: str) -> float:
        """Start a ``dcp_async_stager`` save and return after its staging (the stall)."""
        t0 = time.perf_counter()
        self._bg = dcp.async_save(self.state(), storage_writer=self._writer(url),
                                  async_stager=self._stager_for_job(), process_group=self._dcp_pg)
        return time.perf_counter() - t0

    def async_done(self) -> bool:
        return self._bg is None or self._bg.done()

    def wait_async(self) -> None:
        if self._bg is not None:
            self._bg.result()
            self._bg = None

    def settle(self) -> None:
        """Write back every dirty page of this machine (see ``save_latency._settle``)."""
        os.sync()

    def close_stager(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None


BenchRank = ray.remote(_BenchRank)
