"""Run by tests/e2e/test_real_model.py in its own process (vLLM's engine wants one of its own): the
exported policy's log-probs of a dumped response under transformers and under vLLM, and under the
initial checkpoint. Prints one JSON line."""

from __future__ import annotations

import json
import sys


def main(export: str, initial: str, prompt: str, response: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(export)
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    ids = prompt_ids + tok(response, add_special_tokens=False)["input_ids"]
    n = len(ids) - len(prompt_ids)

    def hf_logprobs(path: str) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, len(prompt_ids) - 1 : -1].float()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[len(prompt_ids) :])[:, None])[:, 0]

    trained, initial_lp = hf_logprobs(export), hf_logprobs(initial)
    llm = LLM(export, dtype="float32", max_model_len=1024, enforce_eager=True, seed=0)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    engine = torch.tensor(
        [out.prompt_logprobs[len(prompt_ids) + k][ids[len(prompt_ids) + k]].logprob for k in range(n)]
    )
    print(
        json.dumps(
            {
                "tokens": n,
                "max_diff_hf_vs_vllm": float((trained - engine).abs().max()),
                "max_diff_trained_vs_initial": float((trained - initial_lp).abs().max()),
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:5])
