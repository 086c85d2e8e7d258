"""Cross-key checks of lengths and batch shapes, the data and the model: batch sizes against ranks,
sequence lengths against the context, the packed token budget, the data options' own relations, the
model source (`rlhf_orch.config.validate.CHECKS` runs them)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from rlhf_orch.config.checks_env import TRAJECTORY_ENVS
from rlhf_orch.config.hardware import Hardware
from rlhf_orch.config.problems import Problem
from rlhf_orch.config.ranges import is_int
from rlhf_orch.config.schema import RootConfig
from rlhf_orch.data.options import DigitTaskConfig, FilesDataConfig
from rlhf_orch.models.options import TinyModelConfig
from rlhf_orch.models.tiny_spec import MIN_HEAD_DIM  # vLLM's CPU attention kernels reject smaller heads
from rlhf_orch.topology.plan import PlacementPlan
from rlhf_orch.transfer.options import PackedTransferConfig


def batch_sizes(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    a = cfg.algo
    problems = []
    if min(a.rollout_batch_size, a.samples_per_prompt, a.train_batch_size, a.micro_batch_size) < 1:
        return []  # reported by _ranges; the arithmetic below needs positive sizes
    seqs = a.rollout_batch_size * a.samples_per_prompt
    if seqs % a.train_batch_size:
        problems.append(
            Problem(
                "algo.train_batch_size",
                a.train_batch_size,
                f"must divide algo.rollout_batch_size x algo.samples_per_prompt = {seqs}; "
                f"use a divisor of {seqs} (e.g. {_largest_divisor_at_most(seqs, a.train_batch_size)})",
            )
        )
    for role in ("actor", "critic"):
        dp = len(plan.slots_for(role))
        if dp == 0:
            continue
        if seqs % dp:
            problems.append(
                Problem(
                    f"placement.{role}_ranks",
                    dp,
                    f"{seqs} sequences per step (rollout_batch_size x samples_per_prompt) do not split over "
                    f"{dp} {role} ranks; use a rank count dividing {seqs} or change algo.rollout_batch_size",
                )
            )
        elif a.train_batch_size % (a.micro_batch_size * dp):
            problems.append(
                Problem(
                    "algo.micro_batch_size",
                    a.micro_batch_size,
                    f"algo.train_batch_size={a.train_batch_size} must be a multiple of micro_batch_size x {role} "
                    f"data-parallel size ({a.micro_batch_size} x {dp}); pick micro_batch_size dividing "
                    f"{a.train_batch_size // dp if a.train_batch_size % dp == 0 else a.train_batch_size}",
                )
            )
    actor_dp = len(plan.slots_for("actor"))
    critic_dp = len(plan.slots_for("critic"))
    if actor_dp and critic_dp and actor_dp % critic_dp:
        problems.append(
            Problem(
                "placement.critic_ranks",
                critic_dp,
                f"experience is sharded over the {actor_dp} actor ranks and each critic rank takes whole shards; "
                f"use a critic rank count that divides {actor_dp}",
            )
        )
    return problems


def _largest_divisor_at_most(n: int, k: int) -> int:
    return max(d for d in range(1, max(min(n, k), 1) + 1) if n % d == 0)


def lengths(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    d, m = cfg.data, cfg.model
    problems = []
    total = d.prompt_max_len + d.response_max_len
    if total > m.context_len:
        problems.append(
            Problem(
                "data.response_max_len",
                d.response_max_len,
                f"data.prompt_max_len + data.response_max_len = {total} exceeds model.context_len={m.context_len}; "
                f"lower data.response_max_len to {max(m.context_len - d.prompt_max_len, 0)} or pick a longer-context model",
            )
        )
    if is_int(cfg.algo.min_response_len) and cfg.algo.min_response_len > d.response_max_len:
        problems.append(
            Problem(
                "algo.min_response_len",
                cfg.algo.min_response_len,
                f"a response cannot have more than data.response_max_len={d.response_max_len} tokens; "
                f"set algo.min_response_len <= {d.response_max_len}",
            )
        )
    if is_int(cfg.algo.min_response_len) and cfg.algo.min_response_len > 0 and isinstance(cfg.env, TRAJECTORY_ENVS):
        problems.append(
            Problem(
                "algo.min_response_len",
                cfg.algo.min_response_len,
                "a multi-turn trajectory's turns end where the environment needs them to (a tool call, an answer); "
                "a minimum length per response would run past them: leave algo.min_response_len=0 with env",
            )
        )
    return problems


def transfer(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    """The packed token budget vs sequence length; prompt sharing needs packed micro-batches."""
    t, d, a = cfg.transfer, cfg.data, cfg.algo
    if not isinstance(t, PackedTransferConfig):
        if cfg.trainer.share_prompts:
            return [
                Problem(
                    "trainer.share_prompts",
                    True,
                    "a shared prompt needs packed micro-batches (padded ones keep a row "
                    "per sequence): use transfer=packed, or leave trainer.share_prompts null",
                )
            ]
        return []
    longest = d.prompt_max_len + d.response_max_len
    if t.token_budget < 0:
        return [
            Problem(
                "transfer.token_budget", t.token_budget, f"must be >= 0; 0 derives algo.micro_batch_size x {longest}"
            )
        ]
    if 0 < t.token_budget < longest:
        return [
            Problem(
                "transfer.token_budget",
                t.token_budget,
                f"a sequence can be data.prompt_max_len + data.response_max_len = {longest} tokens and must fit one "
                f"micro-batch; set transfer.token_budget >= {longest} (or 0 to derive {a.micro_batch_size} x {longest})",
            )
        ]
    return []


def is_local_path(path: Any) -> bool:
    return isinstance(path, str) and path.startswith(("/", "./", "../", "~"))


def model_source(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    problems = []
    path = getattr(cfg.model, "name_or_path", None)
    if is_local_path(path) and not Path(path).expanduser().exists():
        problems.append(
            Problem("model.name_or_path", path, "no such directory; give an existing checkpoint directory or a hub id")
        )
    m = cfg.model
    if isinstance(m, TinyModelConfig) and m.num_heads >= 1 and m.hidden_size >= 1:
        if m.hidden_size % m.num_heads:
            problems.append(
                Problem(
                    "model.num_heads",
                    m.num_heads,
                    f"must divide model.hidden_size={m.hidden_size} "
                    f"(head_dim = hidden_size / num_heads); e.g. num_heads={max(1, m.hidden_size // MIN_HEAD_DIM)}",
                )
            )
        elif m.hidden_size // m.num_heads < MIN_HEAD_DIM:
            problems.append(
                Problem(
                    "model.num_heads",
                    m.num_heads,
                    f"head_dim = model.hidden_size / num_heads = "
                    f"{m.hidden_size // m.num_heads} < {MIN_HEAD_DIM}, which vLLM's CPU attention refuses; use "
                    f"num_heads <= {max(1, m.hidden_size // MIN_HEAD_DIM)} or a larger hidden_size",
                )
            )
        need = _tiny_min_vocab()
        if m.vocab_size < need:
            problems.append(
                Problem(
                    "model.vocab_size",
                    m.vocab_size,
                    f"the tiny tokenizer needs >= {need} tokens (4 special tokens, "
                    "the task's characters and one token per task word); use e.g. 64",
                )
            )
    return problems


_TINY_SPECIAL_TOKENS = 4  # tiny_build.SPECIAL_TOKENS: pad, bos, eos, unk


def _tiny_min_vocab() -> int:
    """Smallest BPE vocabulary holding every task word as one token (as tiny_build trains it)."""
    from rlhf_orch.data.digit_task import DigitReverseTask

    words = DigitReverseTask.vocabulary_words()
    alphabet = {"▁"} | {ch for w in words for ch in w}  # Metaspace marks each word start with "▁"
    merges = sum(len(w) for w in words)  # "▁" + n characters -> one token takes n merges
    return _TINY_SPECIAL_TOKENS + len(alphabet) + merges


def data(cfg: RootConfig, plan: PlacementPlan, hw: Hardware) -> list[Problem]:
    d = cfg.data
    problems = []
    sizes_ok = min(d.prompt_max_len, d.response_max_len) >= 1 and getattr(d, "filler_tokens", 0) >= 0
    if isinstance(d, DigitTaskConfig) and sizes_ok:  # (bad sizes themselves: `_ranges`)
        if d.min_digits > d.max_digits:
            problems.append(Problem("data.min_digits", d.min_digits, f"must be <= data.max_digits={d.max_digits}"))
        if d.long_tail_len > d.response_max_len:
            problems.append(
                Problem("data.long_tail_len", d.long_tail_len, f"must be <= data.response_max_len={d.response_max_len}")
            )
        if bool(d.long_tail_frac) != bool(d.long_tail_len):
            key, value = (
                ("data.long_tail_len", d.long_tail_len)
                if d.long_tail_len
                else ("data.long_tail_frac", d.long_tail_frac)
            )
            problems.append(
                Problem(
                    key,
                    value,
                    "does nothing alone: set both data.long_tail_frac (> 0) and data.long_tail_len (> 0), or neither",
                )
            )
        prompt_tokens = 1 + d.filler_tokens + 1 + d.max_digits + 1  # BOS, filler, "rev", digits, "="
        if prompt_tokens > d.prompt_max_len:
            problems.append(
                Problem(
                    "data.prompt_max_len",
                    d.prompt_max_len,
                    f"prompts take up to {prompt_tokens} tokens (BOS + "
                    f"data.filler_tokens={d.filler_tokens} + rev + data.max_digits={d.max_digits} + =): raise it to "
                    f">= {prompt_tokens} or lower filler_tokens/max_digits",
                )
            )
        if d.max_digits + 1 > d.response_max_len:
            problems.append(
                Problem(
                    "data.response_max_len",
                    d.response_max_len,
                    f"the answer takes up to {d.max_digits + 1} tokens "
                    f"(data.max_digits={d.max_digits} + EOS): raise it to >= {d.max_digits + 1}",
                )
            )
    if isinstance(d, FilesDataConfig):
        from rlhf_orch.data.base import DataError
        from rlhf_orch.data.files import DEFAULT_LABEL_KEY, PromptDataset

        try:
            PromptDataset._check_template(d.prompt_template, d.prompt_key)
        except DataError as e:
            problems.append(Problem("data.prompt_template", d.prompt_template, str(e).split(": ", 1)[-1]))
        if d.label_columns is not None:
            if d.label_key is not None and d.label_key != DEFAULT_LABEL_KEY:
                problems.append(
                    Problem(
                        "data.label_key",
                        d.label_key,
                        "data.label_columns gives the label; set data.label_key=null (or data.label_columns=null)",
                    )
                )
            if d.label_regex is not None:
                problems.append(
                    Problem(
                        "data.label_regex",
                        d.label_regex,
                        "applies to data.label_key only; remove it or set data.label_columns=null",
                    )
                )
        if d.label_regex is not None:
            try:
                re.compile(d.label_regex)
            except re.error as e:
                problems.append(Problem("data.label_regex", d.label_regex, f"not a regular expression ({e})"))
    return problems
