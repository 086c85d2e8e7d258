"""`logger.rollouts_every_n_steps`: the rollout dump of every n-th step only (steps n, 2n, ...), the
loop asking the policy ranks to keep sequences on those steps alone."""

from __future__ import annotations

from types import SimpleNamespace

from rlhf_orch.logging.rollout_dump import RolloutDump
from rlhf_orch.orchestration.loop import TrainLoop


def test_the_dump_is_written_on_every_n_th_step_only(tmp_path):
    every_third = RolloutDump(tmp_path, tokenizer=None, per_step=2, every_n_steps=3)
    assert [step for step in range(1, 10) if every_third.dumps(step)] == [3, 6, 9]
    every_step = RolloutDump(tmp_path, tokenizer=None, per_step=2, every_n_steps=1)
    assert all(every_step.dumps(step) for step in range(1, 10))


def test_the_loop_keeps_sequences_for_the_dump_only_on_dump_steps(tmp_path):
    loop = SimpleNamespace(rollout_dump=RolloutDump(tmp_path, tokenizer=None, per_step=2, every_n_steps=2))
    delivery = SimpleNamespace(meta=SimpleNamespace(indices=[3, 0, 1, 2]))
    assert TrainLoop._dumped_indices(loop, 1, delivery) == []  # `train` keeps nothing, no rank is asked
    assert TrainLoop._dumped_indices(loop, 2, delivery) == [0, 1]  # the two lowest indices
    assert TrainLoop._dumped_indices(SimpleNamespace(rollout_dump=None), 2, delivery) == []


def test_vllm_s_version_spans_become_each_token_s_version():
    """pipeline=async: vLLM labels a completion's tokens with spans (start, end, version as a
    string); the dump shows each token's version (prompt tokens: the version it started with)."""
    from types import SimpleNamespace as Span

    from rlhf_orch.engines.shared_steps import version_spans
    from rlhf_orch.logging.rollout_dump import token_versions

    spans = version_spans([Span(start=0, end=2, version="4"), Span(start=2, end=5, version="5")])
    assert spans == ((0, 2, 4), (2, 5, 5)) and version_spans(None) is None and version_spans([]) is None
    assert token_versions(8, 3, 4, spans) == [4, 4, 4, 4, 4, 5, 5, 5]
    assert token_versions(4, 2, 7, None) == [7, 7, 7, 7]


class _SlowByteTokenizer:
    """A tokenizer without a fast backend whose ids are UTF-8 bytes (a character may span tokens)."""

    def decode(self, ids, skip_special_tokens=False):
        return bytes(ids).decode("utf-8", errors="replace")


def test_a_slow_tokenizer_s_token_texts_join_to_the_text():
    from rlhf_orch.logging import rollout_dump
    from rlhf_orch.logging.rollout_dump import token_texts

    tok = _SlowByteTokenizer()
    ids = list("a€b".encode())  # "€" is three byte tokens: it shows on the third
    assert token_texts(tok, ids) == ["a", "", "", "€", "b"]
    cut = list("a€".encode())[:-1]  # cut inside the character (a truncated response): nothing lost
    assert "".join(token_texts(tok, cut)) == tok.decode(cut)
    # Past PREFIX_DECODE_MAX tokens: each token decoded alone (linear, a view of the tokens).
    original = rollout_dump.PREFIX_DECODE_MAX
    rollout_dump.PREFIX_DECODE_MAX = 2
    try:
        assert token_texts(tok, list(b"abc")) == ["a", "b", "c"]
    finally:
        rollout_dump.PREFIX_DECODE_MAX = original
