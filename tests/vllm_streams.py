"""Run by tests/test_vllm_rollout.py in a process of its own (vLLM sets process-wide torch
and environment options): the vLLM engine's token sampler over in-flight sequences, run
straight and continued from a saved state, with the reference model's log-probs beside.
Writes one JSON document to the path it is given."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from workers.engines import VLLMEngine
from workers.models import BOS, EOS, PAD, encode, token_logprobs
from workers.streaming import Streams


def streams() -> Streams:
    return Streams(seed=7, temperature=1.0, max_new_tokens=6, pad=PAD, eos=EOS,
                   device=torch.device("cpu"))


def items() -> list[dict]:
    return [{"epoch": 0, "pid": p, "sample": j, "prompt": [BOS, *encode(f"{p}+{p}=")],
             "tokens": [], "versions": [], "logprobs": []} for p in range(3) for j in range(2)]


def run_out(s: Streams, sampler) -> list[dict]:
    done = []
    while s.live:
        done += s.step(sampler, 0)
    return done


def main() -> None:
    engine = VLLMEngine({}, 0, 0, 1.0, 6, torch.device("cpu"), {"enable_prefix_caching": False})
    sampler = engine.stream_sampler()
    straight = streams()
    straight.admit(items())
    whole = run_out(straight, sampler)
    first = streams()
    first.admit(items())
    early = first.step(sampler, 0) + first.step(sampler, 0)
    saved = json.loads(json.dumps(first.state()))
    engine.llm.reset_prefix_cache()
    second = streams()  # another rank: it holds only what the checkpoint holds
    second.load(saved)
    rest = run_out(second, sampler)
    reference = []
    with torch.no_grad():
        for d in whole:
            ids = torch.tensor([d["prompt"] + d["tokens"]])
            lp = token_logprobs(engine.reference(input_ids=ids).logits, ids)[0]
            reference.append(lp[len(d["prompt"]) - 1:].tolist())
    doc = {"whole": whole, "early": early, "saved": saved, "rest": rest, "reference": reference,
           "generated_after_load": second.tokens_generated, "pad": PAD}
    Path(sys.argv[1]).write_text(json.dumps(doc))


if __name__ == "__main__":
    main()
