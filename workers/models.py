"""Tiny language models and a tokenizer built in code (nothing is ever downloaded).

The policy is a Hugging Face ``LlamaForCausalLM`` (or ``Qwen2ForCausalLM``) built from a
small config, so exported weights load in ``transformers`` and vLLM; the tokenizer is a
character-level ``PreTrainedTokenizerFast``.  The value model (critic, reward model) is
the same backbone with a scalar head.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

SPECIALS = ["<pad>", "<bos>", "<eos>"]
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 :=+")
PAD, BOS, EOS = 0, 1, 2


def build_tokenizer():
    """A character-level fast tokenizer over :data:`CHARS` with pad/bos/eos."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<pad>")


def vocab_size() -> int:
    return len(SPECIALS) + len(CHARS)


def encode(text: str) -> list[int]:
    """Token ids of ``text`` (the same ids the HF tokenizer produces, without its import)."""
    index = {c: i + len(SPECIALS) for i, c in enumerate(CHARS)}
    return [index.get(c, PAD) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(CHARS[i - len(SPECIALS)] for i in ids if i >= len(SPECIALS))


def build_config(model: dict[str, Any]) -> Any:
    """An HF config from the job's ``actor_rollout_ref.model`` options."""
    from transformers import LlamaConfig, Qwen2Config

    arch = model.get("arch", "llama")
    common = dict(vocab_size=vocab_size(), hidden_size=model.get("hidden_size", 64),
                  intermediate_size=model.get("intermediate_size", 128),
                  num_hidden_layers=model.get("num_layers", 2),
                  num_attention_heads=model.get("num_heads", 1),
                  num_key_value_heads=model.get("num_heads", 1),
                  max_position_embeddings=model.get("max_positions", 64),
                  pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
                  tie_word_embeddings=False)
    if arch == "llama":
        return LlamaConfig(head_dim=common["hidden_size"] // common["num_attention_heads"], **common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    raise ValueError(f"actor_rollout_ref.model.arch must be 'llama' or 'qwen2', got {arch!r}")


def build_causal_lm(model: dict[str, Any], seed: int) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(build_config(model), attn_implementation="eager")


def hf_assets(model: nn.Module) -> dict[str, bytes]:
    """``{file name: bytes}`` of a causal LM's config, generation config and tokenizer."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        build_tokenizer().save_pretrained(tmp)
        out = {}
        for name in sorted(os.listdir(tmp)):
            with open(os.path.join(tmp, name), "rb") as f:
                out[name] = f.read()
        return out


class ValueModel(nn.Module):
    """Backbone of the causal LM plus a scalar head: one value per token."""

    def __init__(self, model: dict[str, Any], seed: int) -> None:
        super().__init__()
        from transformers import AutoModel

        torch.manual_seed(seed)
        self.backbone = AutoModel.from_config(build_config(model), attn_implementation="eager")
        self.value_head = nn.Linear(self.backbone.config.hidden_size, 1)

    @property
    def layers(self) -> nn.ModuleList:
        return self.backbone.layers

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.value_head(hidden).squeeze(-1)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    if isinstance(model, ValueModel):
        return model.layers
    return model.model.layers


def state_sha256(state: dict[str, torch.Tensor]) -> str:
    """sha256 over a state dict's names and float32 values, in name order."""
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().contiguous().float().numpy().tobytes())
    return h.hexdigest()


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens[t+1] | tokens[:t+1]) for every position; shape (B, T-1)."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
