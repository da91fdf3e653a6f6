"""The RL job's asynchronous mode (``async_training.enable=true``): rollout beside training.

Rollout ranks hold sequences in flight and advance them a token at a time
(:mod:`workers.streaming`, with either engine of :mod:`workers.engines`); prompts come from
the dispatcher and finished sequences go to the sample queue (:mod:`drivers.async_hub`).
Each training step takes ``data.train_batch_size`` complete GRPO groups from the queue
(``async_training.require_batches`` times that, one update on each), trains on them with
the rollout's own log-probs as the behaviour policy, and meanwhile the
rollout advances every sequence ``async_training.decode_steps_per_step`` tokens under the
weights of the last sync; every ``async_training.trigger_parameter_sync_step`` updates the
weights go to the rollout and the policy version advances (between two syncs the actor keeps
the rollout's weights, for the checkpoint).  Each token carries the version that produced
it: the dispatcher lets out no prompt that could only be trained on more than
``async_training.staleness_threshold`` versions later (a fraction, as verl's ``0.1``, lets
that fraction of a version's batches out ahead), and a group whose oldest token is further
behind than that (rounded up) is dropped (counted) and its prompt dispatched again.
``staleness_threshold=1`` is one-step-off training: the rollout for step t+1 runs while step
t trains.

Two schedules: ``free`` (the default), where each rollout rank generates on its own thread,
and ``deterministic`` (a fixed number of decode steps per training step, prompts dispatched
to the ranks in rank order), where an asynchronous run is reproducible bit for bit, across
a resume too.  Either way a checkpoint cuts through everything that holds training data
(see :class:`AsyncState`), between two steps, at a token boundary.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
import torch

from drivers.async_hub import SampleHub, without_work
from drivers.groups import RPC, rollout_lags
from drivers.main_ppo import Trainer
from drivers.verl_keys import fail

ROLLOUT_STATES = ("full", "drop")
SCHEDULES = ("free", "deterministic")


def check_async_options(opts: dict[str, Any]) -> None:
    """Refuse, one line each, what the asynchronous mode does not implement."""
    if opts["algorithm.adv_estimator"] != "grpo":
        fail("async_training.enable=true trains GRPO groups from the sample queue: set "
             "algorithm.adv_estimator=grpo")
    if opts["async_training.schedule"] not in SCHEDULES:
        fail(f"async_training.schedule must be one of {SCHEDULES}, got "
             f"{opts['async_training.schedule']!r}")
    if int(opts["async_training.trigger_parameter_sync_step"]) < 1:
        fail("async_training.trigger_parameter_sync_step must be >= 1 (training steps per sync)")
    if int(opts["async_training.require_batches"]) < 1:
        fail("async_training.require_batches must be >= 1 (mini-batches per training step)")
    if float(opts["async_training.staleness_threshold"]) < 0:
        fail("async_training.staleness_threshold must be >= 0 (policy versions)")
    if (opts["async_training.decode_steps_per_step"] or 1) < 1:
        fail("async_training.decode_steps_per_step must be >= 1")
    if opts["checkpoint.rollout_state"] not in ROLLOUT_STATES:
        fail(f"checkpoint.rollout_state must be one of {ROLLOUT_STATES}, got "
             f"{opts['checkpoint.rollout_state']!r}")


class AsyncState:
    """The checkpoint's ``rollout_state.json`` in the asynchronous mode: the dispatcher (data position,
    prompts outstanding), the queue's samples, every rollout rank's in-flight sequences, the
    policy version and the counters.  Read between steps, at a token boundary: in the
    deterministic schedule no rank decodes then; free-running ranks are paused for it (each
    stops at its next token boundary, the queue is read once all have, then all go on).

    ``checkpoint.rollout_state=drop`` keeps only the data position: every prompt dispatched
    and not trained on is dispatched again after a resume (what other frameworks do).
    """

    def __init__(self, trainer: AsyncTrainer) -> None:
        self.t = trainer
        self.last_pause_s = 0.0  # the rollout's pause at the last save (copying its state)

    def state_dict(self) -> dict[str, Any]:
        t = self.t
        if t.opts["checkpoint.rollout_state"] == "drop":
            self.last_pause_s = 0.0
            return {"rollout_state": "drop", "version": t.version,
                    "hub": ray.get(t.hub.data_position.remote(), timeout=RPC)}
        ranks = t.groups["rollout"]
        if not t.free:
            states = ray.get([w.stream_state.remote() for w in ranks], timeout=RPC)
            self.last_pause_s = max(s["pause_s"] for s in states)
            hub = ray.get(t.hub.state.remote(), timeout=RPC)
        else:
            paused = [w.stream_pause.remote() for w in ranks]
            try:
                states = ray.get(paused, timeout=RPC)
                hub = ray.get(t.hub.state.remote(), timeout=RPC)
            finally:
                ray.wait(paused, num_returns=len(paused), timeout=RPC)
                self.last_pause_s = max(ray.get([w.stream_resume.remote() for w in ranks],
                                                timeout=RPC))
        return {"rollout_state": "full", "version": t.version, "hub": hub,
                "inflight": [s["live"] for s in states],
                "generated": [s["generated"] for s in states]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        t = self.t
        t.version = int(state["version"])
        ranks = t.groups["rollout"]
        inflight = [s for rank in state.get("inflight") or [] for s in rank]
        drop = t.opts["checkpoint.rollout_state"] == "drop" or state["rollout_state"] == "drop"
        parts: list[list[dict[str, Any]]] = [[] for _ in ranks]
        if drop:  # in-flight and queued work is generated again
            t.discarded_tokens = sum(len(s["tokens"])
                                     for s in inflight + state["hub"]["queue"]["sequences"])
            ray.get(t.hub.load.remote(without_work(state["hub"])), timeout=RPC)
        else:
            ray.get(t.hub.load.remote(state["hub"]), timeout=RPC)
            if len(state["inflight"]) == len(ranks):
                parts = state["inflight"]
            else:  # resharded: whole prompts to the ranks in turn, in their saved order
                turn = {k: i % len(ranks) for i, k in enumerate(
                    dict.fromkeys((s["epoch"], s["pid"]) for s in inflight))}
                for s in inflight:
                    parts[turn[(s["epoch"], s["pid"])]].append(s)
        ray.get([w.stream_load.remote(p) for w, p in zip(ranks, parts, strict=True)], timeout=RPC)
        t.live = [len(p) for p in parts]
        if drop:
            t.events.append(f"rollout state dropped: {t.discarded_tokens} tokens in flight or queued "
                            "are generated again")
        else:
            queued = len(state["hub"]["queue"]["sequences"])
            t.events.append(f"rollout state restored: {len(inflight)} sequences in flight on "
                            f"{len(ranks)} rank(s) (saved on {len(state['inflight'])}), {queued} "
                            f"queued, policy version {t.version}")


class AsyncTrainer(Trainer):
    def __init__(self, opts: dict[str, Any]) -> None:
        check_async_options(opts)
        if opts["async_training.schedule"] == "deterministic":
            # a token computed from a vLLM prefix cache's blocks is not bit for bit the token a
            # resumed engine, whose cache is empty, computes: reproducible means no cache
            opts = {**opts, "actor_rollout_ref.rollout.enable_prefix_caching": False}
        super().__init__(opts)
        self.version = 0  # weight syncs so far: the policy version the rollout samples with
        self.staleness = float(opts["async_training.staleness_threshold"])
        self.sync_every = int(opts["async_training.trigger_parameter_sync_step"])
        self.lags = rollout_lags(opts)  # between syncs the rollout's weights are the actor's older ones
        # verl's require_batches: a step takes that many batches, one update on each
        self.step_prompts = self.batch_size * int(opts["async_training.require_batches"])
        # prompts outstanding at most: what the trainer takes under staleness + 1 versions
        self.capacity = math.floor(self.step_prompts * self.sync_every * (self.staleness + 1))
        self.decode_steps = (opts["async_training.decode_steps_per_step"]
                             or opts["actor_rollout_ref.rollout.response_length"])
        self.partial = bool(opts["async_training.partial_rollout"])
        self.free = opts["async_training.schedule"] == "free"
        self.discarded_tokens = 0  # in-flight and queued tokens a drop resume threw away
        self._epoch = 0
        self.state = AsyncState(self)

    def data_state(self) -> None:
        return None  # the data position is the dispatcher's, in the rollout state

    def rollout_state(self) -> AsyncState:
        return self.state

    @property
    def epoch(self) -> int:
        return self._epoch

    def start(self) -> None:
        super().start()
        ranks = self.groups["rollout"]
        self.live = [0] * len(ranks)  # sequences in flight per rollout rank
        self.per_rank = math.ceil(self.capacity / len(ranks)) * self.n  # sequences per rank
        self.hub = SampleHub.remote([self.vocab.prompt_ids(r["prompt"]) for r in self.rows],
                                    seed=self.opts["data.seed"], n=self.n,
                                    batch=self.step_prompts, staleness=self.staleness,
                                    sync_every=self.sync_every)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-rounds")
        self.generated = [0] * len(ranks)  # tokens each rank generated (deterministic schedule)

    # ---- the rollout side -------------------------------------------------------------------

    def rollout_round(self, *, admit: bool = True) -> int:
        """Fill each rank's free slots with prompts (in rank order), then one token for every
        sequence in flight; finished sequences go to the queue in rank order.  Returns the
        number of sequences that were in flight."""
        ranks = self.groups["rollout"]
        if admit:
            for r, w in enumerate(ranks):
                room = (self.per_rank - self.live[r]) // self.n
                new = ray.get(self.hub.dispatch.remote(room, self.version), timeout=RPC) if room > 0 else []
                if new:
                    self.live[r] = ray.get(w.stream_admit.remote(new), timeout=RPC)
        busy = [r for r in range(len(ranks)) if self.live[r]]
        outs = ray.get([ranks[r].stream_step.remote(1, self.version) for r in busy], timeout=RPC)
        for r, out in zip(busy, outs, strict=True):
            self.live[r] = out["live"]
            self.generated[r] = out["generated"]
        finished = [s for out in outs for s in out["finished"]]
        if finished:
            ray.get(self.hub.push.remote(finished), timeout=RPC)
        return len(busy)

    def take_batch(self) -> dict[str, Any]:
        """A step's complete groups (``data.train_batch_size x require_batches``): in the
        deterministic schedule decoding (blocking) until there are, free-running waiting for
        the ranks to finish them."""
        deadline = time.monotonic() + RPC
        while True:
            got = ray.get(self.hub.take.remote(self.step_prompts, self.version), timeout=RPC)
            if got is not None:
                return got
            if self.free:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no batch of {self.step_prompts} complete groups in {RPC}s")
                ray.get([w.stream_check.remote() for w in self.groups["rollout"]], timeout=RPC)
                time.sleep(0.005)
            elif not self.rollout_round():
                counters = ray.get(self.hub.counters.remote(), timeout=RPC)
                raise RuntimeError("the rollout has nothing in flight and the dispatcher gives no "
                                   "prompt, but the queue holds no batch (policy version "
                                   f"{self.version}, {counters})")

    # ---- a step ---------------------------------------------------------------------------------

    def train_step(self, step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        got = self.take_batch()
        waited = time.perf_counter() - t0
        groups = [sorted(g, key=lambda s: s["sample"]) for g in got["groups"]]
        self._epoch = max(g[0]["epoch"] for g in groups)
        # the rollout advances beside the update, under the weights of the last sync
        beside = None if self.free else self.pool.submit(self.rollout_rounds, self.decode_steps)
        seqs = [s for g in groups for s in g]
        # require_batches mini-batches of data.train_batch_size groups, one update each
        parts = [self.train_on(groups[i:i + self.batch_size], last=i + self.batch_size >= len(groups))
                 for i in range(0, len(groups), self.batch_size)]
        out = {k: sum(p[k] for p in parts) / len(parts) for k in ("loss", "kl", "reward", "rule_reward")}
        out["lr"] = parts[-1]["lr"]
        syncs = step % self.sync_every == 0  # trigger_parameter_sync_step
        if beside is not None:
            beside.result(timeout=RPC)
            if syncs and not self.partial:  # in flight: finish under the weights they began with
                while any(self.live):
                    self.rollout_round(admit=False)
        stale = [self.version - min(s["versions"]) for s in seqs]
        policy = self.version
        if syncs:
            self.version += 1
            if self.lags:  # the actor keeps them: the rollout's until the next sync
                ray.get([w.keep_rollout_weights.remote() for w in self.groups["actor"]],
                        timeout=RPC)
            self.sync_rollout()  # free-running ranks apply it at a token boundary (or drain first)
        counters = ray.get(self.hub.counters.remote(), timeout=RPC)
        out.update(policy_version=policy, staleness_mean=sum(stale) / len(stale),
                   staleness_max=max(stale), dropped_groups=counters["dropped_groups"],
                   queue_depth=counters["queue_depth"],
                   in_flight=counters["outstanding"] * self.n - counters["queue_depth"],
                   tokens_trained=sum(len(s["tokens"]) for s in seqs), batch_wait_s=waited)
        if not self.free:
            out["tokens_generated"] = sum(self.generated)
        self.batch_keys = [[g[0]["epoch"], g[0]["pid"]] for g in groups]
        return out

    def train_on(self, groups: list[list[dict[str, Any]]], *, last: bool) -> dict[str, Any]:
        """One update on complete groups, the rollout's log-probs the behaviour policy's."""
        seqs = [s for g in groups for s in g]
        prompts = [g[0]["prompt"] for g in groups]
        batch, rewards, rule = self.score(prompts, [s["tokens"] for s in seqs],
                                          [self.rows[g[0]["pid"]]["target"] for g in groups
                                           for _ in g])
        old = torch.zeros(batch["response_mask"].shape, dtype=torch.float32)
        for i, s in enumerate(seqs):
            start = len(s["prompt"]) - 1
            old[i, start:start + len(s["logprobs"])] = torch.tensor(s["logprobs"])
        return self.update(batch, rewards, rule, old_logprobs=old, last=last)

    def sync_rollout(self, **how: Any) -> None:
        super().sync_rollout(version=self.version, partial=self.partial, **how)

    def rollout_weights(self) -> dict[str, Any]:
        return {"rollout": True} if self.lags else {}

    def before_steps(self) -> None:
        """Free-running: each rollout rank starts generating on its own (after the load)."""
        if self.free:
            ray.get([w.stream_run.remote(self.hub, per_rank=self.per_rank, n=self.n,
                                         version=self.version, timeout_s=RPC)
                     for w in self.groups["rollout"]], timeout=RPC)

    def run(self) -> int:
        try:
            return super().run()
        finally:
            if self.free:
                ray.get([w.stream_stop.remote() for w in self.groups["rollout"]], timeout=RPC)

    def rollout_rounds(self, k: int) -> None:
        for _ in range(k):
            self.rollout_round()

    def step_extras(self, saves: list[Any]) -> dict[str, Any]:
        """The prompts the step trained on, and the rollout's pause for the step's save."""
        out: dict[str, Any] = {"batch_prompts": self.batch_keys}
        if saves:
            pause = round(self.state.last_pause_s, 6)
            for h in saves:
                self.save_notes[h.name] = {"rollout_pause_s": pause}
            out["ckpt_rollout_pause_s"] = pause
        return out
