"""Building the tiny policy: train a tokenizer, initialise a small Llama, warm-start it, save both.

Everything here is seeded and single-process, so the same spec gives the same checkpoint. Caching,
locking and atomic publication live in rlhf_orch.models.tiny; this module only writes a directory.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rlhf_orch.data.digit_task import ANSWER_MARKER, DigitReverseTask
from rlhf_orch.models.tiny_spec import TinyLlamaSpec, WarmStartRecipe

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)

# The tiny model knows no roles: its chat template renders the user turns as the plain task text
# after BOS, so chat-format rows (veRL's parquet layout) of the digit task reach the model exactly as
# the plain prompts do (same token ids), and `data.chat_template=true` works with it. A conversation
# renders as the tool-use task writes a trajectory (`rlhf_orch.data.lookup_task`): an assistant
# turn is its words after a space (none for an empty turn), then EOS; a tool or later user turn its
# text as is. So a conversation an agent sends back re-renders the model's own tokens exactly
# (`env=agent` merges its calls).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{% if message['content'] %}{{ ' ' + message['content'] }}{% endif %}{{ eos_token }}"
    "{% elif message['role'] in ('user', 'tool') %}{{ message['content'] }}{% endif %}{% endfor %}"
)


def train_tokenizer(task: DigitReverseTask, vocab_size: int, corpus_size: int) -> PreTrainedTokenizerFast:
    """A byte-pair tokenizer trained on the task corpus, with every task word as a single token.

    Metaspace pre-tokenisation marks word starts with "▁" and BPE merges each "▁<word>" into one
    token, which is what makes the task's token counts exact (see rlhf_orch.data.digit_task).
    """
    tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    # The vocabulary line is repeated so rare words (fillers never appear in the default corpus)
    # still earn their merge.
    vocabulary_line = " ".join(task.vocabulary_words())
    texts = task.corpus(corpus_size) + [vocabulary_line] * 50
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    for word in task.vocabulary_words():
        pieces = tokenizer.encode(word, add_special_tokens=False).tokens
        if len(pieces) != 1:
            raise RuntimeError(f"task word {word!r} is {pieces} with vocab_size {vocab_size}; raise it")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def init_llama(spec: TinyLlamaSpec, tokenizer: PreTrainedTokenizerFast, seed: int) -> LlamaForCausalLM:
    if len(tokenizer) > spec.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but vocab_size is {spec.vocab_size}")
    config = LlamaConfig(
        # Exactly the tokenizer's size: spare embedding rows would be ids the tokenizer cannot
        # decode, and PPO's temperature-1 sampling does draw them now and then.
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.context_len,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def _corrupt_answer(answer_text: str, noise: float, rng: np.random.Generator) -> str:
    """Each answer digit replaced by a uniformly random digit with probability `noise`.

    The length is kept: the policy should stop at the right place, only the digits are unsure.
    """
    words = answer_text.split()
    for i in range(len(words)):
        if rng.random() < noise:
            words[i] = str(int(rng.integers(0, 10)))
    return " ".join(words)


def _tokenize_supervised(
    texts: list[str], tokenizer: PreTrainedTokenizerFast, answer_noise: float, seed: int
) -> tuple[list[list[int]], list[int]]:
    """Token ids of each (noisy) solved text + EOS, and how many leading tokens are prompt."""
    rng = np.random.default_rng(seed)
    sequences: list[list[int]] = []
    prompt_lengths: list[int] = []
    for text in texts:
        prompt_text, answer_text = text.rsplit(f" {ANSWER_MARKER} ", 1)
        answer_text = _corrupt_answer(answer_text, answer_noise, rng)
        prompt_ids = tokenizer(f"{prompt_text} {ANSWER_MARKER}").input_ids
        answer_ids = tokenizer(answer_text, add_special_tokens=False).input_ids
        sequences.append(prompt_ids + answer_ids + [tokenizer.eos_token_id])
        prompt_lengths.append(len(prompt_ids))
    return sequences, prompt_lengths


def _answer_examples(
    texts: list[str], tokenizer: PreTrainedTokenizerFast, noise: float, seed: int
) -> tuple[list[list[int]], list[list[bool]]]:
    """The digit task's demonstrations: token ids, trained on everything after the prompt."""
    sequences, prompt_lengths = _tokenize_supervised(texts, tokenizer, noise, seed=seed)
    trained = [[t >= prompt_len for t in range(len(seq))] for seq, prompt_len in zip(sequences, prompt_lengths)]
    return sequences, trained


def _collate(sequences: list[list[int]], trained: list[list[bool]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ids, attention mask and labels (-100 where a token is not trained on)."""
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    labels = torch.full((len(sequences), width), -100, dtype=torch.long)
    for row, (seq, mask) in enumerate(zip(sequences, trained)):
        ids = torch.tensor(seq, dtype=torch.long)
        input_ids[row, : len(seq)] = ids
        attention_mask[row, : len(seq)] = 1
        labels[row, : len(seq)] = torch.where(torch.tensor(mask), ids, torch.full_like(ids, -100))
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _sgd_step(model: LlamaForCausalLM, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> float:
    loss = model(**batch).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def _long_context_task(task: DigitReverseTask, recipe: WarmStartRecipe) -> DigitReverseTask | None:
    """The same task behind `long_context_filler` filler tokens (None when disabled)."""
    if recipe.long_context_every <= 0 or recipe.long_context_batch <= 0:
        return None
    filler = recipe.long_context_filler
    return DigitReverseTask(
        prompt_max_len=filler + task.max_prompt_tokens,
        response_max_len=task.response_max_len,
        seed=task.seed + 1,  # its own stream: never the PPO prompts
        min_digits=task.min_digits,
        max_digits=task.max_digits,
        filler_tokens=filler,
    )


def warm_start(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    task: DigitReverseTask,
    steps: int,
    recipe: WarmStartRecipe,
) -> list[float]:
    """`steps` AdamW steps of answer-only cross-entropy (see WarmStartRecipe); returns the losses."""
    if steps == 0:
        return []
    texts = task.corpus(steps * recipe.batch_size)
    long_task = _long_context_task(task, recipe)
    long_steps = len(range(0, steps, recipe.long_context_every)) if long_task else 0  # an upper bound
    long_texts = long_task.corpus(long_steps * recipe.long_context_batch) if long_task else []
    long_done = 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
    model.train()
    losses: list[float] = []
    start = 0
    for phase, (phase_steps, lr, noise) in enumerate(recipe.phases(steps)):
        for group in optimizer.param_groups:
            group["lr"] = lr
        phase_texts = texts[start * recipe.batch_size : (start + phase_steps) * recipe.batch_size]
        # A task with multi-turn demonstrations says which tokens are trained on; the digit task's
        # are its answers (everything after the prompt).
        examples = getattr(task, "warm_start_examples", _answer_examples)
        sequences, trained = examples(phase_texts, tokenizer, noise, recipe.init_seed + phase)
        for step in range(phase_steps):
            rows = slice(step * recipe.batch_size, (step + 1) * recipe.batch_size)
            losses.append(_sgd_step(model, optimizer, _collate(sequences[rows], trained[rows], tokenizer.pad_token_id)))
            # Long-context batches only in the clean phase: mixed into the noisy phase they also
            # blur the short-context skill PPO starts from (measured: initial reward 0.30 -> 0.19).
            if long_task and noise == 0.0 and (start + step) % recipe.long_context_every == 0:
                chunk = long_texts[long_done * recipe.long_context_batch : (long_done + 1) * recipe.long_context_batch]
                long_seqs, long_trained = _answer_examples(chunk, tokenizer, noise, recipe.init_seed + 100 + long_done)
                _sgd_step(model, optimizer, _collate(long_seqs, long_trained, tokenizer.pad_token_id))
                long_done += 1
        start += phase_steps
    model.eval()
    return losses


def build_tiny_checkpoint(out_dir: Path, spec: TinyLlamaSpec, task: DigitReverseTask, recipe: WarmStartRecipe) -> None:
    """Write a loadable checkpoint (model, tokenizer, generation config, build_info.json) to out_dir."""
    spec.validate()
    started = time.perf_counter()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    try:
        tokenizer = train_tokenizer(task, spec.vocab_size, recipe.tokenizer_corpus_size)
        tokenizer.model_max_length = spec.context_len
        model = init_llama(spec, tokenizer, recipe.init_seed)
        losses = warm_start(model, tokenizer, task, spec.warmup_steps, recipe)
    finally:
        torch.set_num_threads(previous_threads)
    model.to(getattr(torch, spec.dtype))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(out_dir)
    info = {
        "spec": asdict(spec),
        "recipe": asdict(recipe),
        "task": task.definition(),
        "tokenizer_size": len(tokenizer),
        "warm_start_first_loss": losses[0] if losses else None,
        "warm_start_final_loss": losses[-1] if losses else None,
        "build_seconds": round(time.perf_counter() - started, 2),
        "built_at": time.time(),
    }
    (out_dir / "build_info.json").write_text(json.dumps(info, indent=2))
