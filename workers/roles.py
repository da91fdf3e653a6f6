"""The RL roles on top of ShardedModelWorker: actor, reference, critic, reward.

Every method that takes a batch receives this rank's slice of it (the driver splits
the global batch evenly over the role's ranks; FSDP averages gradients across them).
Batch tensors: ``input_ids`` and ``attention_mask`` of shape (N, T), ``response_mask``
(N, T-1) marking the positions that predict response tokens.  They arrive on cpu, are
moved to the rank's device, and results go back on cpu.
"""

from __future__ import annotations

from typing import Any

import ray
import torch
from torch.distributed.tensor import DTensor

from workers.device import to_device, to_host
from workers.models import Vocab, state_sha256, token_logprobs
from workers.sharded import ShardedModelWorker


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


@ray.remote
class PolicyWorker(ShardedModelWorker):
    """The actor (trainable) or the reference policy (``trainable=False``).

    ``rollout_weights=True`` (the asynchronous job syncing the rollout every
    ``trigger_parameter_sync_step > 1`` steps): between two syncs the rollout samples with
    the weights of the last one, no longer the actor's, so the actor keeps a copy of its
    shard of them (:meth:`keep_rollout_weights`, one more copy of the shard in the rank's
    memory) and its checkpoints hold it beside the model (``"rollout_model"``, sharded like
    the model); a resume syncs the rollout from it.
    """

    def __init__(self, *, rollout_weights: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.rollout_weights: dict[str, torch.Tensor] | None = None
        if rollout_weights:
            self.keep_rollout_weights()  # the initial weights are version 0's

    def keep_rollout_weights(self) -> None:
        """The weights just synced to the rollout: a copy of this rank's shard of them."""
        self.ckpt_wait_copy()  # an overlapped save may still be copying the kept ones
        with torch.no_grad():
            model = self._state_dicts.model_state_dict()
            kept = self.rollout_weights
            if kept is None or kept.keys() != model.keys():
                self.rollout_weights = {k: v.detach().clone() for k, v in model.items()}
            else:  # in place: a checkpoint's state dict holds these very tensors
                for k, v in model.items():
                    kept[k].copy_(v)

    def _rollout_full(self) -> dict[str, torch.Tensor]:
        """The kept rollout weights unsharded (a collective: every rank of the role calls)."""
        if self.rollout_weights is None:
            raise RuntimeError("this actor keeps no rollout weights (rollout_weights=False)")
        return {k: v.full_tensor() if isinstance(v, DTensor) else v
                for k, v in self.rollout_weights.items()}

    def full_weights(self, rollout: bool = False) -> dict[str, torch.Tensor] | None:
        """The unsharded weights on rank 0 (None elsewhere); ``rollout``: those of the last
        sync to the rollout (:meth:`keep_rollout_weights`)."""
        if not rollout:
            return super().full_weights()
        full = {k: v.cpu() for k, v in self._rollout_full().items()}
        return full if self.rank == 0 else None

    def weights_sha256(self, rollout: bool = False) -> str:
        return state_sha256(self._rollout_full()) if rollout else super().weights_sha256()

    def ckpt_state_dict(self, kind: str) -> dict[str, Any]:
        state = super().ckpt_state_dict(kind)
        if self.rollout_weights is not None:
            state["rollout_model"] = dict(self.rollout_weights)
        return state

    def ckpt_load_state_dict(self, state: dict[str, Any], kind: str) -> None:
        super().ckpt_load_state_dict(state, kind)
        loaded, kept = state.get("rollout_model"), self.rollout_weights
        if loaded is not None and kept is not None:
            with torch.no_grad():
                for k, v in loaded.items():
                    if v is not kept[k]:  # a load fills the kept tensors in place
                        kept[k].copy_(v)

    def logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return to_host(self._logprobs(to_device(batch, self.device)))

    def _logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            logits = self.net(input_ids=batch["input_ids"],
                              attention_mask=batch["attention_mask"]).logits
        return token_logprobs(logits, batch["input_ids"])

    def update(self, batch: dict[str, torch.Tensor], *, advantages: torch.Tensor,
               ref_logprobs: torch.Tensor, clip: float, kl_coef: float,
               old_logprobs: torch.Tensor | None = None,
               step_scheduler: bool = True) -> dict[str, float]:
        """One PPO-clip step with a KL penalty to the reference on response tokens.

        ``old_logprobs``: the behaviour policy's log-probs (the asynchronous job's rollout,
        some policy versions behind); default: this policy's own before the step.
        ``step_scheduler=False``: a mini-batch before the step's last (the LR schedule
        advances once per training step)."""
        batch = to_device(batch, self.device)
        advantages, ref_logprobs = advantages.to(self.device), ref_logprobs.to(self.device)
        mask = batch["response_mask"].float()
        old = self._logprobs(batch) if old_logprobs is None else old_logprobs.to(self.device)
        logits = self.net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logp = token_logprobs(logits, batch["input_ids"])
        ratio = torch.exp(logp - old)
        pg = -torch.min(ratio * advantages, torch.clamp(ratio, 1 - clip, 1 + clip) * advantages)
        # k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 >= 0
        delta = ref_logprobs - logp
        kl = torch.exp(delta) - delta - 1
        loss = _masked_mean(pg + kl_coef * kl, mask)
        self._optimizer_step(loss, step_scheduler)
        return {"pg_loss": float(_masked_mean(pg, mask).detach()),
                "kl": float(_masked_mean(kl, mask).detach()), "loss": float(loss.detach()),
                "lr": float(self.sched.get_last_lr()[0])}


@ray.remote
class CriticWorker(ShardedModelWorker):
    """PPO's value model: per-token values, trained toward the GAE returns."""

    def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        batch = to_device(batch, self.device)
        with torch.no_grad():
            v = self.net(batch["input_ids"], batch["attention_mask"])
        return to_host(v[:, :-1]).float()  # value of the state before each predicted token

    def update(self, batch: dict[str, torch.Tensor], *, returns: torch.Tensor) -> dict[str, float]:
        batch, returns = to_device(batch, self.device), returns.to(self.device)
        v = self.net(batch["input_ids"], batch["attention_mask"])[:, :-1]
        loss = _masked_mean((v - returns) ** 2, batch["response_mask"].float())
        self._optimizer_step(loss)
        return {"value_loss": float(loss.detach())}


@ray.remote
class RewardWorker(ShardedModelWorker):
    """A frozen reward model combined with a rule-based score.

    The rule: the fraction of the response equal to the prompt's target character (the
    task is to repeat it), read through the job's tokenizer.  The model's score on the last token is
    squashed and weighted by ``rm_coef``.
    """

    def score(self, batch: dict[str, torch.Tensor], responses: list[list[int]],
              targets: list[str], rm_coef: float) -> dict[str, list[float]]:
        if getattr(self, "vocab", None) is None:  # the rule reads the responses' text
            self.vocab = Vocab(self.model_spec.get("tokenizer_path"))
        batch = to_device(batch, self.device)
        with torch.no_grad():
            values = self.net(batch["input_ids"], batch["attention_mask"])
        last = batch["attention_mask"].sum(dim=1) - 1
        rm = to_host(torch.tanh(values[torch.arange(values.shape[0]), last])).float()
        rule = [self._rule(r, t) for r, t in zip(responses, targets, strict=True)]
        total = [r + rm_coef * float(m) for r, m in zip(rule, rm, strict=True)]
        return {"reward": total, "rule": rule}

    def _rule(self, response: list[int], target: str) -> float:
        """The fraction of the response equal to ``target``: per token with the built-in
        character vocabulary (an end token counts as a miss), per character of the decoded
        text with a model directory's tokenizer (a token may hold several characters)."""
        text = self.vocab.decode(response)
        hits = sum(c == target for c in text)
        return hits / max(1, len(response) if self.vocab.tokenizer is None else len(text))
