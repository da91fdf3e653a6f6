"""PPO / GRPO post-training of a tiny policy with raycheckpoint, verl style.

    python -m drivers.main_ppo algorithm.adv_estimator=grpo trainer.total_training_steps=10 ...
    ray job submit --working-dir . -- python -m drivers.main_ppo ...

Worker groups (each of ``trainer.n_gpus_per_node * trainer.nnodes`` ranks): actor,
reference, reward, rollout, and critic for ``gae``.  One line per step is printed and
appended to ``metrics.jsonl``; checkpoints follow the ``trainer.*`` and ``checkpoint.*``
keys (see drivers/config.py).  SIGTERM (``ray job stop``, preemption) makes an emergency
full save and exits; ``python -m raycheckpoint.request ROOT --tag T`` saves from outside.
"""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
import signal
import sys
import time
from typing import Any

import fsspec
import ray
import torch
from fsspec.implementations.local import LocalFileSystem

from drivers import algos, data, verl_keys
from drivers._ray import init_ray
from drivers.config import parse_overrides, section, storage_options
from drivers.exports import HFExports
from drivers.groups import RPC, start_groups
from drivers.job_spec import (  # noqa: F401 - job_description: `raycheckpoint diff`'s path
    DataState,
    dataset_args,
    fingerprint,
    job_description,
    per_rank,
    role_worlds,
    roles_of,
)
from raycheckpoint import (
    CheckpointConfig,
    CheckpointManager,
    CheckpointNotFoundError,
    ConfigMismatchError,
    IntegrityError,
    LeaseHeldError,
    LightCheckpointError,
    ResumableSampler,
)
from raycheckpoint.errors import StorageCapabilityError
from raycheckpoint.integrity.crypto import EncryptionKeyError, FileCipher, load_key
from raycheckpoint.resume import preflight
from raycheckpoint.roots import read_tiers
from workers.models import Vocab, check_model_dir, parameter_bytes


class Trainer:
    def __init__(self, opts: dict[str, Any]) -> None:
        self.opts = opts
        self.root = str(opts["trainer.default_local_dir"]).rstrip("/")
        self.storage_options = storage_options(opts)
        self.world = opts["trainer.n_gpus_per_node"] * opts["trainer.nnodes"]
        self.n = opts["actor_rollout_ref.rollout.n"]
        self.batch_size = opts["data.train_batch_size"]
        verl_keys.validate(opts)
        if self.batch_size % self.world:
            raise SystemExit(f"error: data.train_batch_size={self.batch_size} must be a multiple "
                             f"of the world size {self.world}")
        self.data_path = opts["data.train_files"] or f"{self.root}/data/train.jsonl"
        self.rows, data_sha = data.load_or_generate(self.data_path, self.storage_options,
                                                    **dataset_args(opts))
        self.total_steps = verl_keys.total_steps(opts, len(self.rows) // self.batch_size)
        for key in ("actor_rollout_ref.model.path", "critic.model.path", "reward_model.model.path"):
            if opts[key]:
                try:
                    check_model_dir(opts[key], key)
                except FileNotFoundError as e:
                    raise SystemExit(f"error: {e}") from None
        self.vocab = Vocab(opts["actor_rollout_ref.model.path"])
        self.ckpt_config = CheckpointConfig.from_dict(
            {"save_dir": self.root, "storage_options": self.storage_options,
             **verl_keys.checkpoint_settings(opts)})
        self.fingerprint = fingerprint(opts, data_sha, len(self.rows))
        self.resume_ref = None
        if self.ckpt_config.resume_mode != "disable":
            # refuse a mismatched resume before starting a single worker
            self.resume_ref = ("auto" if self.ckpt_config.resume_mode == "auto"
                               else self.ckpt_config.resume_from)
            if self.resume_ref is None:
                raise SystemExit("error: resume_mode=resume_path needs trainer.resume_from_path")
            # the candidates the load will take, on every tier, in the same order
            cipher = (FileCipher(load_key(self.ckpt_config.encryption_key))
                      if self.ckpt_config.encryption_key else None)
            preflight(read_tiers(self.ckpt_config, cipher), self.resume_ref, self.fingerprint,
                      role_worlds(opts), allow_reshard=self.ckpt_config.allow_reshard,
                      cipher=cipher)
        self.sampler = ResumableSampler(len(self.rows), seed=opts["data.seed"])
        metrics = opts["trainer.metrics_file"] or f"{self.root}/metrics.jsonl"
        self.metrics_file = metrics
        self.exports = None
        if verl_keys.exports_hf(opts):  # hf_model: an HF export beside each committed checkpoint
            if self.ckpt_config.encryption_key:
                raise SystemExit("error: save_contents hf_model writes a plaintext export; this root "
                                 "is encrypted (checkpoint.encryption_key)")
            self.exports = HFExports(self.root, self.storage_options)
        self.events: list[str] = []
        self.finished_saves: list[dict[str, Any]] = []  # checkpoint_stats entries not yet logged
        self._seen_stats = 0
        self._copy_waits: list[float] | None = None  # per trainable rank, at the last step
        self.save_notes: dict[str, dict[str, Any]] = {}  # added to a save's checkpoint_stats

    def start(self) -> None:
        """Start (or join) Ray, the worker groups and the checkpoint manager."""
        # the local Ray's object store carries the actor's weights to the rollout on every sync
        init_ray(model_bytes=lambda: parameter_bytes(section(self.opts, "actor_rollout_ref.model.")))
        self.groups, device = start_groups(self.opts, roles_of(self.opts), role_worlds(self.opts),
                                           self.total_steps)
        if device == "cuda" and "checkpoint.overlap_copy" not in self.opts:
            # on GPUs the device-to-host copy runs on its stream beside the next step
            self.ckpt_config = dataclasses.replace(self.ckpt_config, overlap_copy=True)
        self.manager = CheckpointManager(
            self.ckpt_config, self.groups, dataloader=self.data_state(), rollout_state=self.rollout_state(),
            fingerprint=self.fingerprint,
            frozen_roles=["reference", "reward"])

    def data_state(self) -> Any:
        """What the checkpoint's data-loader slot holds (the sampler's position)."""
        return DataState(self.sampler)

    def before_steps(self) -> None:
        """After the load and the first weight sync, before the first step (nothing here)."""

    def rollout_state(self) -> Any:
        """The asynchronous mode's rollout side (none here)."""
        return None

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    # ---- pieces of a step ---------------------------------------------------------------

    def rollout_weights(self) -> dict[str, Any]:
        """Which of the actor's weights the rollout samples with: its own (``{}``), or
        (the asynchronous mode) those of the last sync (``{"rollout": True}``)."""
        return {}

    def sync_rollout(self, **how: Any) -> None:
        """The actor's weights to every rollout rank (``how``: more of ``set_weights``'s
        arguments, as the asynchronous mode gives them)."""
        weights = ray.get([w.full_weights.remote(**self.rollout_weights())
                           for w in self.groups["actor"]], timeout=RPC)[0]
        ref = ray.put(weights)
        ray.get([w.set_weights.remote(ref, **how) for w in self.groups["rollout"]], timeout=RPC)

    def check_rollout_synced(self) -> str:
        """After a load: every rollout rank must hold exactly the weights it was synced."""
        actor = ray.get([w.weights_sha256.remote(**self.rollout_weights())
                         for w in self.groups["actor"]], timeout=RPC)[0]
        rollout = ray.get([w.weights_sha256.remote() for w in self.groups["rollout"]], timeout=RPC)
        if any(r != actor for r in rollout):
            raise RuntimeError(f"rollout weights {rollout} differ from the actor's {actor} after sync")
        return actor

    def rollout_and_score(self, rows: list[dict[str, Any]]):
        prompts = [self.vocab.prompt_ids(r["prompt"]) for r in rows]
        rollout = self.groups["rollout"]
        chunk = len(prompts) // len(rollout)
        outs = ray.get([w.generate.remote(prompts[i * chunk:(i + 1) * chunk], self.n)
                        for i, w in enumerate(rollout)], timeout=RPC)
        responses = [r for out in outs for r in out]
        return self.score(prompts, responses, [rows[i // self.n]["target"]
                                               for i in range(len(responses))])

    def score(self, prompts: list[list[int]], responses: list[list[int]], targets: list[str]):
        """The batch of ``n`` consecutive ``responses`` per prompt, their rewards and rule scores."""
        batch = algos.build_batch(prompts, responses, self.n, pad=self.vocab.pad)
        scored = ray.get(per_rank(self.groups["reward"], "score", batch,
                                  {"responses": responses, "targets": targets},
                                  rm_coef=self.opts["reward_model.rm_coef"]), timeout=RPC)
        rewards = torch.tensor([x for s in scored for x in s["reward"]])
        rule = [x for s in scored for x in s["rule"]]
        return batch, rewards, rule

    def train_step(self, step: int) -> dict[str, Any]:
        rows = [self.rows[i] for i in self.sampler.next_batch(self.batch_size)]
        # a save due at this step rides on it: begun now (the data drawn), each rank
        # snapshots right after its update, before the driver's next call reaches it
        ride = (self.manager.step_save(step, epoch=self.sampler.epoch,
                                       is_last=step == self.total_steps)
                if self.opts["trainer.save_with_step"] else None)
        batch, rewards, rule = self.rollout_and_score(rows)
        out = self.update(batch, rewards, rule, ride=ride)
        self.sync_rollout()
        return out

    def update(self, batch: dict[str, torch.Tensor], rewards: torch.Tensor, rule: list[float], *,
               old_logprobs: torch.Tensor | None = None, ride: Any = None,
               last: bool = True) -> dict[str, Any]:
        """Advantages, the critic's and the actor's updates on ``batch``; the step's metrics.
        ``old_logprobs``: the behaviour policy's (the rollout's), else the actor's own.
        ``last=False``: a mini-batch before the step's last (the LR schedule stays)."""
        o = self.opts
        ref_lp = torch.cat(ray.get(per_rank(self.groups["reference"], "logprobs", batch), timeout=RPC))
        mask = batch["response_mask"]
        out: dict[str, Any] = {}
        if o["algorithm.adv_estimator"] == "gae":
            values = torch.cat(ray.get(per_rank(self.groups["critic"], "values", batch), timeout=RPC))
            adv, returns = algos.gae_advantages(rewards, values, mask, gamma=o["algorithm.gamma"],
                                                lam=o["algorithm.lam"])
            crit = ray.get(per_rank(self.groups["critic"], "update", batch, {"returns": returns}),
                           timeout=RPC)
            out["value_loss"] = sum(c["value_loss"] for c in crit) / len(crit)
        else:
            adv = algos.grpo_advantages(rewards, self.n, mask)
        extra = {"advantages": adv, "ref_logprobs": ref_lp}
        if old_logprobs is not None:
            extra["old_logprobs"] = old_logprobs
        more = {} if last else {"step_scheduler": False}
        upd = per_rank(self.groups["actor"], "update", batch, extra, **more,
                       clip=o["actor_rollout_ref.actor.clip_ratio"],
                       kl_coef=o["actor_rollout_ref.actor.kl_loss_coef"]
                       if o["actor_rollout_ref.actor.use_kl_loss"] else 0.0)
        if ride is not None:
            ride.snapshot()  # queued behind the update on each actor rank
        upd = ray.get(upd, timeout=RPC)
        out.update(loss=sum(u["loss"] for u in upd) / len(upd), kl=sum(u["kl"] for u in upd) / len(upd),
                   reward=float(rewards.mean()), rule_reward=sum(rule) / len(rule), lr=upd[0]["lr"])
        return out

    # ---- checkpoint events ------------------------------------------------------------------

    def copy_wait(self) -> float:
        """With ``overlap_copy``: how long this step's optimizer steps waited for the last
        save's host copy (the most any trainable rank waited), part of the blocked time."""
        if not self.manager.config.overlap_copy:
            return 0.0
        ranks = [w for role in ("actor", "critic") for w in self.groups.get(role, [])]
        totals = ray.get([w.ckpt_status.remote() for w in ranks], timeout=RPC)
        seen = self._copy_waits or [0.0] * len(ranks)
        self._copy_waits = [t["copy_wait_s"] for t in totals]
        return max((now - before for now, before in zip(self._copy_waits, seen, strict=True)),
                   default=0.0)

    def step_extras(self, saves: list[Any]) -> dict[str, Any]:
        """More entries of the step's metrics record, given the saves it made (none here)."""
        return {}

    def collect_commits(self) -> None:
        stats = self.manager.checkpoint_stats
        for s in stats[self._seen_stats:]:
            self.events.append(f"committed {s['name']}" if s["ok"]
                               else f"failed {s['name']}: {s.get('error')}")
            self.events += [f"warning {s['name']}: {a}" for a in s.get("anomalies", [])]
            s = {**s, **self.save_notes.pop(s["name"], {})}
            self.finished_saves.append(s)
            if s["ok"] and self.exports is not None:
                self.exports.submit(s["name"])
        if self.exports is not None:
            self.events += self.exports.finished()
        self._seen_stats = len(stats)

    def write_metrics(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, sort_keys=True)
        print(line, flush=True)
        fs, path = fsspec.core.url_to_fs(self.metrics_file, **self.storage_options)
        if isinstance(fs, LocalFileSystem):
            fs.makedirs(posixpath.dirname(path), exist_ok=True)
            with fs.open(path, "a") as f:
                f.write(line + "\n")
        else:  # object stores cannot append: rewrite the (small) file
            old = fs.cat_file(path).decode() if fs.exists(path) else ""
            fs.pipe_file(path, (old + line + "\n").encode())

    # ---- the loop ---------------------------------------------------------------------------------

    def run(self) -> int:
        o = self.opts
        self.manager.watch_preemption()  # a SIGTERM while resuming stops after the first step
        start = 0
        if self.resume_ref is not None:
            loaded = self.manager.load_checkpoint(self.resume_ref, strict=True)
            if loaded is not None:
                start = loaded.step
                note = f" (resharded {loaded.resharded})" if loaded.resharded else ""
                print(f"resumed from {loaded.name} at step {loaded.step}{note}", flush=True)
                self.events.append(f"resumed {loaded.name}{note}")
        self.sync_rollout()
        self.before_steps()
        if start:
            sha = self.check_rollout_synced()
            self.events.append(f"rollout weights re-synced from actor: sha256 {sha}")
        total = self.total_steps
        for step in range(start + 1, total + 1):
            t0 = time.perf_counter()
            out = self.train_step(step)
            # the manager saves what the config asks for: requests from outside, triggers,
            # and on SIGTERM an emergency full save, committed before should_stop turns True
            self.manager.step(step, epoch=self.epoch, is_last=step == total,
                              metrics={"loss": out["loss"], "reward": out["reward"]})
            saves = self.manager.last_saves
            self.events += [f"save {h.name} {h.kind}" + (f" tag={h.tag}" if h.tag else "")
                            + f" ({h.reason})" for h in saves]
            blocked = sum(h.stall_s for h in saves) + self.copy_wait()
            noted = self.step_extras(saves)
            self.collect_commits()
            sha = ray.get([w.weights_sha256.remote() for w in self.groups["actor"]], timeout=RPC)[0]
            record = {"step": step, "epoch": self.epoch, **{k: round(v, 6) for k, v in out.items()},
                      "ckpt_events": self.events, "step_time_s": round(time.perf_counter() - t0, 4),
                      "ckpt_blocked_s": round(blocked, 4), **noted, "actor_weights_sha256": sha,
                      "checkpoint_stats": self.finished_saves}
            self.events, self.finished_saves = [], []
            self.write_metrics(record)
            if self.manager.should_stop:
                print(f"stopped by signal {self.manager.stop_signal} after step {step}; emergency "
                      "checkpoint committed", flush=True)
                return 0
            if step == o["trainer.crash_at_step"]:
                if o["trainer.crash_once_committed"]:
                    self.manager.wait_for_saves(RPC)
                os.kill(os.getpid(), signal.SIGKILL)
            if o["trainer.step_delay_s"]:
                time.sleep(o["trainer.step_delay_s"])
        self.manager.wait_for_saves(RPC)
        self.collect_commits()
        if self.exports is not None:  # exports that finished after the last step's record
            for line in [e for e in self.events if e.startswith("hf export")] + self.exports.close(RPC):
                print(line, flush=True)
        for s in self.manager.checkpoint_stats:
            print(f"checkpoint {s['name']}: {s.get('bytes', 0) / 1e6:.2f} MB, stall "
                  f"{s['stall_s'] * 1e3:.1f} ms, committed after {s.get('total_s', 0):.2f} s", flush=True)
        sha = ray.get([w.weights_sha256.remote() for w in self.groups["actor"]], timeout=RPC)[0]
        print(f"final actor weights sha256 {sha}", flush=True)
        return 0


def main(argv: list[str] | None = None) -> int:
    opts = parse_overrides(sys.argv[1:] if argv is None else argv)
    try:
        if opts["async_training.enable"]:
            from drivers.async_ppo import AsyncTrainer

            trainer: Trainer = AsyncTrainer(opts)
        else:
            trainer = Trainer(opts)
    except (ConfigMismatchError, CheckpointNotFoundError, IntegrityError,
            LightCheckpointError, EncryptionKeyError) as e:
        print(f"error: cannot resume: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        trainer.start()
    except (LeaseHeldError, StorageCapabilityError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        return trainer.run()
    finally:
        trainer.manager.close(RPC)


if __name__ == "__main__":
    sys.exit(main())
