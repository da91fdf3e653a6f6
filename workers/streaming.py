"""Token-by-token generation for the asynchronous RL job: a rollout rank's in-flight sequences.

A sequence is one response of one prompt: ``(epoch, prompt id, sample index)``, the prompt's
token ids and, so far, its response tokens, each with the policy version that produced it
and its log-prob under that policy.  :class:`Streams` admits sequences, advances every one
of them by one token per :meth:`Streams.step`, and hands out the finished ones; between two
steps (a token boundary) its whole state is :meth:`Streams.state`, plain lists that a
checkpoint stores and any rollout rank can take back (:meth:`Streams.load`).

Sampling needs no per-rank generator: token ``t`` of a sequence is drawn with a seed made
from ``(seed, epoch, prompt id, sample, t)`` (a torch generator's here, a vLLM request's in
:class:`workers.engines.VLLMEngine`), so a sequence continues identically on whichever rank
holds it after a resume, and two ranks never share a random stream.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

FIELDS = ("epoch", "pid", "sample", "prompt", "tokens", "versions", "logprobs")


@dataclass
class Sequence:
    epoch: int
    pid: int  # the prompt's row in the dataset
    sample: int  # which of the prompt's n responses
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # policy version of each token
    logprobs: list[float] = field(default_factory=list)  # under that version, temperature 1

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sequence:
        missing = [k for k in FIELDS if k not in d]
        if missing:
            raise ValueError(f"an in-flight sequence without {missing}")
        # the lists are copied: a sequence grows its own, never the caller's
        seq = cls(**{k: list(d[k]) if isinstance(d[k], list) else d[k] for k in FIELDS})
        if not (len(seq.tokens) == len(seq.versions) == len(seq.logprobs)):
            raise ValueError(f"sequence {seq.key}: {len(seq.tokens)} tokens, {len(seq.versions)} "
                             f"versions, {len(seq.logprobs)} log-probs")
        return seq

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.epoch, self.pid, self.sample)


# An engine's token sampler: for each sequence, with its seed, the next token and its raw
# (temperature-1) log-prob under the engine's weights.
Sampler = Callable[[list[Sequence], list[int]], list[tuple[int, float]]]


def token_seed(seed: int, seq: Sequence) -> int:
    """The seed of ``seq``'s next token: a function of the sequence and position only."""
    text = f"{seed}:{seq.epoch}:{seq.pid}:{seq.sample}:{len(seq.tokens)}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") & (2**63 - 1)


class Streams:
    """A rollout rank's in-flight sequences, advanced a token at a time."""

    def __init__(self, *, seed: int, temperature: float, max_new_tokens: int, pad: int,
                 eos: int, device: torch.device) -> None:
        self.seed, self.temperature, self.max_new_tokens = seed, temperature, max_new_tokens
        self.pad, self.eos, self.device = pad, eos, device
        self.live: list[Sequence] = []
        self.tokens_generated = 0  # since this rank started: what a resume regenerates shows here

    def admit(self, items: list[dict[str, Any]]) -> None:
        self.live += [Sequence.from_dict(d) for d in items]

    def done(self, seq: Sequence) -> bool:
        return len(seq.tokens) >= self.max_new_tokens or bool(seq.tokens and seq.tokens[-1] == self.eos)

    def step(self, model: torch.nn.Module | Sampler, version: int) -> list[dict[str, Any]]:
        """One token for every live sequence, produced by policy ``version``; returns the
        sequences that finished, in admission order.  ``model`` is the policy as a torch
        module (sampled here) or an engine's :data:`Sampler` (vLLM's)."""
        sample = self.torch_sampler(model) if isinstance(model, torch.nn.Module) else model
        seeds = [token_seed(self.seed, seq) for seq in self.live]
        drawn = sample(self.live, seeds) if self.live else []
        if len(drawn) != len(self.live):
            raise RuntimeError(f"the rollout engine sampled {len(drawn)} tokens for "
                               f"{len(self.live)} sequences")
        for seq, (tok, logp) in zip(self.live, drawn, strict=True):
            seq.tokens.append(int(tok))
            seq.versions.append(version)
            seq.logprobs.append(float(logp))
        self.tokens_generated += len(self.live)
        finished = [s for s in self.live if self.done(s)]
        self.live = [s for s in self.live if not self.done(s)]
        return [asdict(s) for s in finished]

    def torch_sampler(self, net: torch.nn.Module) -> Sampler:
        """Sample with a torch module: sequences of equal length share a forward pass, each
        token drawn from the temperature's distribution (never ``pad`` mid-response) with its
        own seed, its log-prob the temperature-1 one."""

        @torch.no_grad()
        def sample(seqs: list[Sequence], seeds: list[int]) -> list[tuple[int, float]]:
            out: list[tuple[int, float]] = [(0, 0.0)] * len(seqs)
            by_length: dict[int, list[int]] = {}
            for i, seq in enumerate(seqs):
                by_length.setdefault(len(seq.prompt) + len(seq.tokens), []).append(i)
            for group in by_length.values():
                ids = torch.tensor([seqs[i].prompt + seqs[i].tokens for i in group],
                                   dtype=torch.long, device=self.device)
                logits = net(input_ids=ids).logits[:, -1].float()
                logp = torch.log_softmax(logits, dim=-1)
                probs = torch.softmax(logits / self.temperature, dim=-1)
                if self.pad != self.eos:
                    probs[:, self.pad] = 0  # never pad mid-response
                for row, i in enumerate(group):
                    gen = torch.Generator(device=self.device).manual_seed(seeds[i])
                    tok = int(torch.multinomial(probs[row], 1, generator=gen))
                    out[i] = (tok, float(logp[row, tok]))
            return out

        return sample

    def state(self) -> list[dict[str, Any]]:
        return [asdict(s) for s in self.live]

    def load(self, items: list[dict[str, Any]]) -> None:
        self.live = [Sequence.from_dict(d) for d in items]


class FreeRunning:
    """A rollout rank generating on its own: a thread that takes prompts from the hub
    (``dispatch(k, version)``), advances its sequences a token at a time and pushes the
    finished ones (``push``), until stopped.

    Everything that touches the sequences holds ``lock``, so between two of the thread's
    turns is a token boundary: :meth:`pause` takes the lock (the thread stops there) and
    copies the state, :meth:`resume` lets it go on; a weight swap takes it as well.  A
    failure of the thread is raised by the next call.
    """

    def __init__(self, streams: Streams, model: Callable[[], torch.nn.Module | Sampler], hub: Any, *,
                 per_rank: int, n: int, version: int, timeout_s: float) -> None:
        self.streams, self.model, self.hub = streams, model, hub
        self.per_rank, self.n, self.version, self.timeout_s = per_rank, n, version, timeout_s
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.draining = False  # admit nothing (sequences in flight finish first)
        self.error: BaseException | None = None
        self.paused_at: float | None = None
        self.thread = threading.Thread(target=self._run, name="rollout-free-running", daemon=True)
        self.thread.start()

    def _turn(self) -> bool:
        import ray

        s = self.streams
        room = 0 if self.draining else (self.per_rank - len(s.live)) // self.n
        if room > 0:
            s.admit(ray.get(self.hub.dispatch.remote(room, self.version), timeout=self.timeout_s))
        if not s.live:
            return False
        finished = s.step(self.model(), self.version)
        if finished:  # inside the lock: a sequence is always in flight or in the queue
            ray.get(self.hub.push.remote(finished), timeout=self.timeout_s)
        return True

    def _run(self) -> None:
        try:
            while not self.stopped.is_set():
                with self.lock:
                    busy = self._turn()
                if not busy:
                    self.stopped.wait(0.005)
        except BaseException as e:  # noqa: BLE001 - surfaced by the next call
            self.error = e

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the rollout's generation loop failed: {self.error!r}") from self.error

    def pause(self) -> list[dict[str, Any]]:
        """Stop at the next token boundary; the sequences in flight (held until :meth:`resume`)."""
        self.check()
        if not self.lock.acquire(timeout=self.timeout_s):
            raise TimeoutError(f"the rollout did not reach a token boundary in {self.timeout_s}s")
        self.paused_at = time.perf_counter()
        return self.streams.state()

    def resume(self) -> float:
        """Go on after :meth:`pause`; how long the rank was paused."""
        paused = time.perf_counter() - (self.paused_at or time.perf_counter())
        self.paused_at = None
        self.lock.release()
        return paused

    def swap(self, apply: Callable[[], None], version: int, *, partial: bool) -> None:
        """Apply new weights at a token boundary; without ``partial``, once the sequences in
        flight have finished under the weights they began with."""
        self.check()
        if not partial:
            self.draining = True
            deadline = time.monotonic() + self.timeout_s
            while True:
                with self.lock:
                    if not self.streams.live:
                        break
                self.check()
                if time.monotonic() > deadline:
                    raise TimeoutError("sequences in flight did not finish before the weight sync")
                time.sleep(0.002)
        with self.lock:
            apply()
            self.version = version
            self.draining = False

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(self.timeout_s)
