"""RolloutWorker: generates ``n`` responses per prompt from the current policy weights.

``actor_rollout_ref.rollout.name=hf`` (default) samples with a plain torch loop over a
full (unsharded) copy of the policy; ``vllm`` is not available in this release and is
refused with a clear error.  The engine holds no state worth saving: its checkpoint is
the sampler config and its RNG; after every load the driver re-syncs the weights from
the actor (``set_weights``).
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import ray
import torch

from raycheckpoint.worker import CheckpointableWorker
from workers.models import EOS, PAD, build_causal_lm


@ray.remote
class RolloutWorker(CheckpointableWorker):
    def __init__(self, *, role: str, rank: int, world_size: int, master_addr: str,
                 master_port: int, timeout_s: float = 120.0, model: dict | None = None,
                 seed: int = 0, engine: str = "hf", temperature: float = 1.0,
                 max_new_tokens: int = 8) -> None:
        if engine != "hf":
            raise NotImplementedError(
                f"actor_rollout_ref.rollout.name={engine!r} is not available in this release; "
                "use actor_rollout_ref.rollout.name=hf")
        torch.set_num_threads(1)
        self.role, self.rank, self.world_size = role, rank, world_size
        self.engine, self.temperature, self.max_new_tokens = engine, temperature, max_new_tokens
        self.net = build_causal_lm(dict(model or {}), seed)
        self.net.requires_grad_(False)
        self.net.eval()
        self.gen = torch.Generator().manual_seed(seed * 1000 + 17 + rank)

    def ready(self) -> dict[str, Any]:
        return {"role": self.role, "rank": self.rank, "engine": self.engine}

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self.net.load_state_dict(weights)

    def weights_sha256(self) -> str:
        sd = self.net.state_dict()
        h = hashlib.sha256()
        for k in sorted(sd):
            h.update(k.encode())
            h.update(sd[k].detach().contiguous().float().numpy().tobytes())
        return h.hexdigest()

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        """``n`` sampled responses for each prompt (prompts of equal length), in order."""
        ids = torch.tensor([p for p in prompts for _ in range(n)], dtype=torch.long)
        done = torch.zeros(ids.shape[0], dtype=torch.bool)
        out: list[list[int]] = [[] for _ in range(ids.shape[0])]
        for _ in range(self.max_new_tokens):
            logits = self.net(input_ids=ids).logits[:, -1].float()
            probs = torch.softmax(logits / self.temperature, dim=-1)
            probs[:, PAD] = 0  # never pad mid-response
            nxt = torch.multinomial(probs, 1, generator=self.gen).squeeze(-1)
            for i, t in enumerate(nxt.tolist()):
                if not done[i]:
                    out[i].append(t)
            done |= nxt == EOS
            ids = torch.cat([ids, nxt.unsqueeze(-1)], dim=1)
            if bool(done.all()):
                break
        return out

    # ---- checkpoint: sampler config + RNG only; no engine state -----------------------------

    def ckpt_state_dict(self, kind: str) -> dict[str, Any]:
        return {}

    def ckpt_load_state_dict(self, state: dict[str, Any], kind: str) -> None:
        return None

    def ckpt_extra_state(self) -> dict[str, Any]:
        return {"engine": self.engine, "temperature": self.temperature,
                "max_new_tokens": self.max_new_tokens,
                "generator": base64.b64encode(self.gen.get_state().numpy().tobytes()).decode()}

    def ckpt_load_extra_state(self, extra: dict[str, Any]) -> None:
        state = torch.frombuffer(bytearray(base64.b64decode(extra["generator"])),
                                 dtype=torch.uint8).clone()
        self.gen.set_state(state)
