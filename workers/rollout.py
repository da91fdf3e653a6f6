"""RolloutWorker: generates ``n`` responses per prompt from the current policy weights.

The engine, chosen by ``actor_rollout_ref.rollout.name`` (``hf`` or ``vllm``), is one of
:mod:`workers.engines`.  It holds no state worth saving: a checkpoint of this role is the
sampler config and its RNG position; after every load the driver re-syncs the weights from
the actor (``set_weights``; the asynchronous mode syncing every few steps: the actor's copy
of the weights it last synced) and the engine is never restored from disk.  In the job's
asynchronous mode a rank also holds sequences in flight (``stream_*``,
:mod:`workers.streaming`), which the driver reads into the checkpoint's rollout state.
"""

from __future__ import annotations

import time
from typing import Any

import ray
import torch

from raycheckpoint.worker import CheckpointableWorker, install_clean_exit
from workers.device import rank_device
from workers.engines import ENGINES
from workers.streaming import FreeRunning, Streams


@ray.remote
class RolloutWorker(CheckpointableWorker):
    def __init__(self, *, role: str, rank: int, world_size: int, master_addr: str,
                 master_port: int, timeout_s: float = 120.0, model: dict | None = None,
                 seed: int = 0, engine: str = "hf", temperature: float = 1.0,
                 max_new_tokens: int = 8, device: str = "auto",
                 engine_options: dict[str, Any] | None = None) -> None:
        if engine not in ENGINES:
            raise ValueError(f"actor_rollout_ref.rollout.name must be one of {sorted(ENGINES)}, "
                             f"got {engine!r}")
        torch.set_num_threads(1)
        self.role, self.rank, self.world_size = role, rank, world_size
        install_clean_exit()  # never hang in Ray's C++ teardown
        self.engine_name, self.temperature, self.max_new_tokens = engine, temperature, max_new_tokens
        self.device, self.gpu_ids = rank_device(device, f"{role} rank {rank}")
        self.engine = ENGINES[engine](dict(model or {}), seed, rank, temperature, max_new_tokens,
                                      self.device, dict(engine_options or {}))
        self.streams: Streams | None = None
        self.free: FreeRunning | None = None  # the free-running schedule's generation loop
        self.seed = seed

    def ready(self) -> dict[str, Any]:
        return {"role": self.role, "rank": self.rank, "engine": self.engine_name,
                "device": str(self.device), "gpu_ids": self.gpu_ids,
                "node_id": ray.get_runtime_context().get_node_id()}

    def set_weights(self, weights: dict[str, torch.Tensor], version: int | None = None,
                    partial: bool = True) -> None:
        """New policy weights; while generating on its own (free-running), applied at a token
        boundary as policy ``version`` (``partial``: see :meth:`FreeRunning.swap`)."""
        if self.free is None:
            self.engine.set_weights(weights)
            return
        self.free.swap(lambda: self.engine.set_weights(weights), version, partial=partial)

    def weights_sha256(self) -> str:
        return self.engine.weights_sha256()

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        """``n`` sampled responses for each prompt (prompts of equal length), in order."""
        return self.engine.generate(prompts, n)

    # ---- the asynchronous job: sequences in flight, a token at a time (workers/streaming) ----

    def _streams(self) -> Streams:
        if self.streams is None:
            self.streams = Streams(seed=self.seed, temperature=self.temperature,
                                   max_new_tokens=self.max_new_tokens, pad=self.engine.pad,
                                   eos=self.engine.eos, device=self.device)
        return self.streams

    def stream_admit(self, items: list[dict[str, Any]]) -> int:
        """Take new sequences (``workers.streaming.FIELDS``); returns how many are in flight."""
        streams = self._streams()
        streams.admit(items)
        return len(streams.live)

    def stream_step(self, steps: int, version: int) -> dict[str, Any]:
        """``steps`` tokens for every sequence in flight (fewer once none is left), produced
        by policy ``version``: the finished sequences in order, and how many remain."""
        streams = self._streams()
        finished: list[dict[str, Any]] = []
        for _ in range(steps):
            if not streams.live:
                break
            finished += streams.step(self.engine.stream_sampler(), version)
        return {"finished": finished, "live": len(streams.live),
                "generated": streams.tokens_generated}

    def stream_run(self, hub: Any, *, per_rank: int, n: int, version: int,
                   timeout_s: float = 600.0) -> None:
        """Generate on its own from now on (the free-running schedule): prompts from ``hub``,
        at most ``per_rank`` sequences in flight, finished ones pushed to it."""
        if self.free is not None:
            raise RuntimeError("this rollout rank already generates on its own")
        self.free = FreeRunning(self._streams(), self.engine.stream_sampler, hub, per_rank=per_rank,
                                n=n, version=version, timeout_s=timeout_s)

    def stream_pause(self) -> dict[str, Any]:
        """At the next token boundary: stop, and the sequences in flight (until ``stream_resume``)."""
        if self.free is None:
            raise RuntimeError("stream_pause: this rank does not generate on its own (stream_run)")
        live = self.free.pause()
        return {"live": live, "generated": self._streams().tokens_generated}

    def stream_resume(self) -> float:
        if self.free is None:
            raise RuntimeError("stream_resume: this rank does not generate on its own (stream_run)")
        return self.free.resume()

    def stream_check(self) -> None:
        """Raise the free-running loop's failure, if it failed."""
        if self.free is not None:
            self.free.check()

    def stream_stop(self) -> None:
        if self.free is not None:
            self.free.stop()
            self.free.check()

    def stream_state(self) -> dict[str, Any]:
        """At a token boundary: the sequences in flight, and how long copying them took."""
        t0 = time.perf_counter()
        streams = self._streams()
        live = streams.state()
        return {"live": live, "pause_s": time.perf_counter() - t0,
                "generated": streams.tokens_generated}

    def stream_load(self, items: list[dict[str, Any]]) -> int:
        """Replace the sequences in flight with ``items`` (a resume); returns their number."""
        self._streams().load(items)
        return len(items)

    # ---- checkpoint: sampler config + RNG only; no engine state -----------------------------

    def ckpt_state_dict(self, kind: str) -> dict[str, Any]:
        return {}

    def ckpt_load_state_dict(self, state: dict[str, Any], kind: str) -> None:
        return None

    def ckpt_extra_state(self) -> dict[str, Any]:
        return {"engine": self.engine_name, "temperature": self.temperature,
                "max_new_tokens": self.max_new_tokens, "sampler": self.engine.state()}

    def ckpt_load_extra_state(self, extra: dict[str, Any]) -> None:
        if extra.get("engine", self.engine_name) != self.engine_name:
            return  # another engine's sampler position means nothing to this one
        self.engine.load_state(extra["sampler"])
