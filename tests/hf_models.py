"""Small Hugging Face model directories built here (nothing is fetched from a hub).

Each holds what a downloaded model directory holds: ``config.json``,
``generation_config.json``, ``model.safetensors`` and a byte-level BPE tokenizer trained
on the job's kind of text, so tokens span several characters (``"kkk"``, ``"k:"``), as a
real model's vocabulary does.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

SPECIALS = {
    "llama": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "qwen2": {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
}


def train_tokenizer(arch: str):
    """A byte-level BPE tokenizer with ``arch``'s special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = SPECIALS[arch]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"{c * 3}:{c * n}" for c in string.ascii_lowercase for n in range(1, 9)]
    corpus += [string.ascii_lowercase, string.digits + " :=+", "the answer is"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=sorted(set(specials.values())),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **specials)


def make_model_dir(path: Path, arch: str = "llama", *, seed: int = 0,
                   dtype: torch.dtype = torch.float32, tied: bool = False) -> Path:
    """Write a small ``arch`` causal LM and its tokenizer to ``path`` with save_pretrained."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    tok = train_tokenizer(arch)
    # head_dim 64: one that vLLM's CPU attention supports
    common = dict(vocab_size=len(tok), hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                  eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                  pad_token_id=tok.pad_token_id, tie_word_embeddings=tied)
    config = LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
