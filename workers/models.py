"""The roles' language models and tokenizers: a Hugging Face directory, or built in code.

With ``path`` (``actor_rollout_ref.model.path``, ``critic.model.path``,
``reward_model.model.path``) the model and its tokenizer are loaded from that Hugging Face
directory (config, safetensors weights, tokenizer files) with ``transformers``, in the
dtype its config names.  Without, the policy is a small ``LlamaForCausalLM`` (or
``Qwen2ForCausalLM``) built from the job's config with a character-level
``PreTrainedTokenizerFast`` (nothing is ever downloaded).  Either way exported weights
load in ``transformers`` and vLLM.  The value model (critic, reward model) is the
backbone with a scalar head initialized from the seed.
"""

from __future__ import annotations

import hashlib
import os
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


MODEL_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_model_dir(path: str, key: str = "actor_rollout_ref.model.path") -> None:
    """Refuse a model directory that lacks its config, safetensors weights or tokenizer,
    naming what is missing."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{key}={path}: no such directory (a Hugging Face model "
                                "directory on every node of the job)")
    names = set(os.listdir(path))
    missing = []
    if "config.json" not in names:
        missing.append("config.json")
    if not names & set(MODEL_WEIGHTS) and not any(n.endswith(".safetensors") for n in names):
        missing.append("model.safetensors (weights in safetensors format)")
    if not names & set(TOKENIZER_FILES):
        missing.append("tokenizer.json (or tokenizer.model / vocab.json)")
    if missing:
        raise FileNotFoundError(f"{key}={path}: missing " + ", ".join(missing))


class Vocab:
    """The ids and text conversions the driver, rollout and reward need from a tokenizer.

    The built-in character vocabulary is handled without importing ``transformers``; a
    directory's tokenizer is loaded from it.
    """

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self.tokenizer = None
        if path is None:
            self.bos, self.pad, self.eos = BOS, PAD, EOS
            return
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        if tok.eos_token_id is None:
            raise ValueError(f"the tokenizer in {path} has no eos token: responses could not end")
        self.tokenizer = tok
        self.eos = tok.eos_token_id
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.bos = tok.bos_token_id  # None: sequences start with the prompt itself

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return encode(text)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return decode(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def prompt_ids(self, text: str) -> list[int]:
        """A prompt as the rollout receives it: BOS (when the tokenizer has one) + tokens."""
        return ([] if self.bos is None else [self.bos]) + self.encode(text)


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
    """The causal LM of ``model``: loaded from ``model["path"]``, or built from the config
    with weights drawn from ``seed`` (identical on every rank either way)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if model.get("path"):
        check_model_dir(model["path"], model.get("key", "actor_rollout_ref.model.path"))
        return AutoModelForCausalLM.from_pretrained(model["path"], dtype="auto",
                                                    attn_implementation="eager")
    return AutoModelForCausalLM.from_config(build_config(model), attn_implementation="eager")


def parameter_bytes(model: dict[str, Any]) -> int:
    """Bytes of ``model``'s weights without loading them: its directory's safetensors files,
    or the built-in model's parameters counted on the meta device."""
    if model.get("path"):
        return sum(os.path.getsize(os.path.join(model["path"], n))
                   for n in os.listdir(model["path"]) if n.endswith(".safetensors"))
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(build_config(model), attn_implementation="eager")
    return sum(p.numel() * p.element_size() for p in net.parameters())


def tokenizer_of(model: dict[str, Any]):
    """The Hugging Face tokenizer of ``model``: its directory's, or the built-in one."""
    if model.get("path"):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model["path"])
    return build_tokenizer()


def hf_assets(model: nn.Module, spec: dict[str, Any]) -> dict[str, bytes]:
    """``{file name: bytes}`` of a causal LM's config, generation config and tokenizer."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer_of(spec).save_pretrained(tmp)
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
        if model.get("path"):
            check_model_dir(model["path"], model.get("key", "critic.model.path"))
            self.backbone = AutoModel.from_pretrained(model["path"], dtype="auto",
                                                      attn_implementation="eager")
        else:
            self.backbone = AutoModel.from_config(build_config(model), attn_implementation="eager")
        dtype = next(self.backbone.parameters()).dtype
        self.value_head = nn.Linear(self.backbone.config.hidden_size, 1, dtype=dtype)

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
        h.update(state[k].detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens[t+1] | tokens[:t+1]) for every position; shape (B, T-1)."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
