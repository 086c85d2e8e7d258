"""The tiny model option: builds a loadable Llama + tokenizer once, caches it, shares it safely."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import rlhf_orch.models.tiny as tiny_module
from rlhf_orch.data.digit_task import DigitReverseTask
from rlhf_orch.models import HFModel, TinyLlama
from rlhf_orch.models.hub import ModelSourceError

# Small warm start so the tests stay fast; the architecture is the schema default.
TEST_KWARGS = dict(
    context_len=256,
    dtype="float32",
    hidden_size=128,
    num_layers=2,
    num_heads=2,
    intermediate_size=256,
    vocab_size=64,
    warmup_steps=6,
)


def make_tiny(cache_dir: Path, **overrides) -> TinyLlama:
    kwargs = {**TEST_KWARGS, **overrides}
    return TinyLlama(cache_dir=str(cache_dir), **kwargs)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny_cache")


@pytest.fixture(scope="module")
def built_path(cache_dir: Path) -> str:
    return make_tiny(cache_dir).path()


def test_loads_with_auto_classes(built_path: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(built_path)
    tokenizer = AutoTokenizer.from_pretrained(built_path)
    config = model.config
    assert config.model_type == "llama"
    assert config.max_position_embeddings == TEST_KWARGS["context_len"]
    assert config.hidden_size // config.num_attention_heads >= 32  # vLLM CPU attention
    assert config.tie_word_embeddings
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert len(tokenizer) <= config.vocab_size

    encoded = tokenizer(["rev 3 1 4 ="], return_tensors="pt")
    assert encoded.input_ids[0, 0].item() == tokenizer.bos_token_id
    with torch.no_grad():
        logits = model(**encoded).logits
    assert logits.shape == (1, encoded.input_ids.shape[1], config.vocab_size)
    assert torch.isfinite(logits).all()


def test_tokenizer_special_tokens_and_words(built_path: str) -> None:
    tokenizer = TinyLlama(cache_dir=str(Path(built_path).parent), **TEST_KWARGS).tokenizer()
    assert {tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token} == {"<bos>", "<eos>", "<pad>"}
    assert len({tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}) == 3
    assert tokenizer.model_max_length == TEST_KWARGS["context_len"]
    for word in DigitReverseTask.vocabulary_words():
        assert len(tokenizer(word, add_special_tokens=False).input_ids) == 1, word
    ids = tokenizer("4 1 3", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=True).split() == ["4", "1", "3"]


def test_cached_second_call_does_not_rebuild(cache_dir: Path, built_path: str, monkeypatch) -> None:
    stamp = Path(built_path, "build_info.json").stat().st_mtime_ns

    def refuse_to_build(*args, **kwargs) -> None:
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(tiny_module, "build_tiny_checkpoint", refuse_to_build)
    again = make_tiny(cache_dir)
    assert again.path() == built_path
    assert Path(built_path, "build_info.json").stat().st_mtime_ns == stamp
    assert not list(cache_dir.glob(".*building*"))  # no staging directory left behind


@pytest.mark.extended  # (builds a second model, ~13 s: docs/testing.md)
def test_config_changes_the_cache_key(cache_dir: Path) -> None:
    base = make_tiny(cache_dir)
    assert make_tiny(cache_dir, warmup_steps=7).model_id != base.model_id
    assert make_tiny(cache_dir, hidden_size=256, intermediate_size=512).model_id != base.model_id
    assert make_tiny(cache_dir).model_id == base.model_id
    assert base.model_id in base.path() and base.context_len == 256 and base.dtype == "float32"


def test_rejects_head_dim_below_32(cache_dir: Path) -> None:
    with pytest.raises(ValueError, match="head_dim"):
        make_tiny(cache_dir, num_heads=8)  # 128 / 8 = 16


@pytest.mark.extended  # (builds a second model, ~13 s: docs/testing.md)
def test_build_is_deterministic(built_path: str, tmp_path: Path) -> None:
    other = make_tiny(tmp_path).path()
    first = load_file(str(Path(built_path, "model.safetensors")))
    second = load_file(str(Path(other, "model.safetensors")))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert Path(built_path, "tokenizer.json").read_text() == Path(other, "tokenizer.json").read_text()


def _path_counting_builds(cache_dir: str, log: str) -> str:
    """Run in a child process: count builds in `log`, then ask for the model."""
    real_build = tiny_module.build_tiny_checkpoint

    def counting_build(*args, **kwargs) -> None:
        with open(log, "a") as f:
            f.write("build\n")
        real_build(*args, **kwargs)

    tiny_module.build_tiny_checkpoint = counting_build
    return make_tiny(Path(cache_dir), warmup_steps=2).path()


def test_concurrent_processes_build_once(tmp_path: Path) -> None:
    log = tmp_path / "builds.log"
    context = multiprocessing.get_context("spawn")
    with context.Pool(2) as pool:
        paths = pool.starmap(_path_counting_builds, [(str(tmp_path / "cache"), str(log))] * 2)
    assert paths[0] == paths[1]
    assert log.read_text().count("build") == 1
    assert AutoModelForCausalLM.from_pretrained(paths[0]) is not None


def test_hf_model_passes_name_through() -> None:
    model = HFModel(context_len=32768, dtype="bfloat16", name_or_path="Qwen/Qwen2.5-0.5B-Instruct")
    assert model.path() == "Qwen/Qwen2.5-0.5B-Instruct"
    assert model.model_id == "Qwen/Qwen2.5-0.5B-Instruct"
    assert model.context_len == 32768 and model.dtype == "bfloat16"
    with pytest.raises(ValueError):
        HFModel(context_len=1024, dtype="float32", name_or_path="")


def test_hf_model_tokenizer_from_local_dir(built_path: str) -> None:
    model = HFModel(context_len=256, dtype="float32", name_or_path=built_path)
    assert model.tokenizer().eos_token == "<eos>"


def test_context_len_longer_than_the_checkpoints_positions_is_refused(built_path: str) -> None:
    HFModel(context_len=256, dtype="float32", name_or_path=built_path).check_context_len()  # its own limit: fine
    with pytest.raises(
        ModelSourceError, match=r"model.context_len=512 exceeds the checkpoint's max_position_embeddings=256.*<=256"
    ):
        HFModel(context_len=512, dtype="float32", name_or_path=built_path).check_context_len()


def test_run_inputs_refuse_a_context_len_the_checkpoint_cannot_hold(built_path: str) -> None:
    from rlhf_orch.orchestration.inputs import InputError, prepare_inputs
    from tests.conftest import compose_config

    cfg = compose_config(
        ["model=hf", f"model.name_or_path={built_path}", "model.context_len=4096", "model.dtype=float32"]
    )
    with pytest.raises(InputError, match="model.context_len=4096 exceeds"):
        prepare_inputs(cfg, OmegaConf.to_object(cfg))
