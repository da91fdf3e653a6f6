"""Advantage estimators and batch assembly (driver side, plain torch)."""

from __future__ import annotations

import torch

from workers.models import PAD


def build_batch(prompts: list[list[int]], responses: list[list[int]], n: int,
                pad: int = PAD) -> dict[str, torch.Tensor]:
    """Sequences ``prompt + response`` padded right with ``pad``; masks for attention and
    response.

    ``prompts`` are the token ids the rollout received (BOS first when the tokenizer has
    one); ``responses`` holds ``n`` consecutive responses per prompt.  ``response_mask[:, t]``
    is 1 where position ``t`` predicts a response token (shape (N, T-1)).
    """
    rows = [[*prompts[i // n], *r] for i, r in enumerate(responses)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    response = torch.zeros((len(rows), width - 1), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        attention[i, :len(row)] = 1
        start = len(prompts[i // n])
        response[i, start - 1:len(row) - 1] = 1
    return {"input_ids": ids, "attention_mask": attention, "response_mask": response}


def grpo_advantages(rewards: torch.Tensor, n: int, mask: torch.Tensor) -> torch.Tensor:
    """Group-normalized outcome reward, the same for every response token."""
    groups = rewards.view(-1, n)
    adv = (groups - groups.mean(dim=1, keepdim=True)) / (groups.std(dim=1, keepdim=True) + 1e-6)
    return adv.reshape(-1, 1) * mask.float()


def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *,
                   gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over response tokens with the outcome reward on the last one; (advantages, returns)."""
    m = mask.float()
    length = m.shape[1]
    last = (m * torch.arange(length)).argmax(dim=1)
    token_rewards = torch.zeros_like(m)
    token_rewards[torch.arange(m.shape[0]), last] = rewards
    adv = torch.zeros_like(m)
    running = torch.zeros(m.shape[0])
    for t in reversed(range(length)):
        next_value = values[:, t + 1] * m[:, t + 1] if t + 1 < length else torch.zeros(m.shape[0])
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * m[:, t]
        adv[:, t] = running
    returns = adv + values
    mean = (adv * m).sum() / m.sum()
    var = (((adv - mean) * m) ** 2).sum() / m.sum()
    return (adv - mean) / (var.sqrt() + 1e-8) * m, returns
