"""Run by tests/e2e/test_lora_run.py in its own process (vLLM's engine wants one of its own): a LoRA run's
export, both ways, loaded as they are -- the merged model by transformers and by vLLM, the adapter by
PEFT on the base and by vLLM on the base (`LoRARequest` from the directory) -- and their log-probs of
one sequence, with the base's. Prints one JSON line."""

from __future__ import annotations

import json
import sys


def main(export: str, base: str, sequence: str) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    ids = json.loads(sequence)

    def hf_logprobs(model) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]

    load = lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # noqa: E731
    merged_hf, base_hf = hf_logprobs(load(export)), hf_logprobs(load(base))
    peft_hf = hf_logprobs(PeftModel.from_pretrained(load(base), f"{export}/adapter"))
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def engine_logprobs(llm, **kw) -> torch.Tensor:
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False, **kw)[0]
        return torch.tensor([out.prompt_logprobs[k][ids[k]].logprob for k in range(1, len(ids))])

    merged_vllm = engine_logprobs(LLM(export, dtype="float32", max_model_len=256, enforce_eager=True, seed=0))
    with open(f"{export}/adapter/adapter_config.json") as f:
        rank = json.load(f)["r"]
    served = LLM(
        base,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        seed=0,
        enable_lora=True,
        max_lora_rank=max(rank, 8),
        lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    adapter_vllm = engine_logprobs(served, lora_request=LoRARequest("exported", 1, f"{export}/adapter"))
    diff = lambda a, b: float((a - b).abs().max())  # noqa: E731
    print(
        json.dumps(
            {
                "merged_hf_vs_peft": diff(merged_hf, peft_hf),
                "merged_hf_vs_merged_vllm": diff(merged_hf, merged_vllm),
                "merged_hf_vs_adapter_vllm": diff(merged_hf, adapter_vllm),
                "merged_vs_base": diff(merged_hf, base_hf),
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:4])
