"""`model=smollm2_student`: SmolLM2-135M-Instruct's first decoder layers as a smaller student (the
whole model's embeddings, final norm, tied head, tokenizer and chat template), built from the whole
model's build in the model cache (`rlhf_orch.models.gguf.keep_first_layers`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from rlhf_orch.memory.shapes import shape_of
from rlhf_orch.orchestration.inputs import InputError, prepare_inputs
from rlhf_orch.models.gguf import StudentLayersError, keep_first_layers
from rlhf_orch.models.packaged import check_packaged_gguf_option, gguf_model_id
from rlhf_orch.models.source_error import ModelSourceError
from tests.conftest import compose_config


@pytest.fixture(scope="module")
def student(smollm2_path, tmp_path_factory):
    """`model=smollm2_student` built as a run builds it (`path()`), into a model cache of its own that
    holds the whole model's build (linked in: the whole model is not built again)."""
    cfg = compose_config(["model=smollm2_student"])
    cache = tmp_path_factory.mktemp("cache")
    (cache / Path(smollm2_path).name).symlink_to(smollm2_path)
    model = instantiate(cfg.model, cache_dir=str(cache))
    assert model.whole().checkpoint_dir == cache / Path(smollm2_path).name
    return model, Path(model.path())


def test_the_student_keeps_the_whole_models_first_layers_embeddings_head_and_tokenizer(smollm2_path, student):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    option, student_dir = student
    assert student_dir == option.checkpoint_dir and "first8layers" in student_dir.name
    info = json.loads((student_dir / "build_info.json").read_text())
    assert (info["layers"], info["from"]) == (8, Path(smollm2_path).name)
    teacher = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32)
    assert student.config.num_hidden_layers == 8 and teacher.config.num_hidden_layers == 30
    theirs = teacher.state_dict()
    mine = student.state_dict()
    assert set(mine) == {k for k in theirs if not k.startswith("model.layers.") or int(k.split(".")[2]) < 8}
    for name, tensor in mine.items():
        assert torch.equal(tensor, theirs[name]), name
    assert student.lm_head.weight.data_ptr() == student.model.embed_tokens.weight.data_ptr()  # still tied
    t_tok, s_tok = AutoTokenizer.from_pretrained(smollm2_path), AutoTokenizer.from_pretrained(student_dir)
    assert s_tok.get_vocab() == t_tok.get_vocab() and s_tok.chat_template == t_tok.chat_template
    assert (s_tok.eos_token_id, s_tok.pad_token_id) == (t_tok.eos_token_id, t_tok.pad_token_id)
    # a real gap to close: the student's next-token distribution is far from the teacher's on an
    # answer the teacher wrote in its own template
    ids = t_tok.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": "3 + 4 = 7."}],
        tokenize=True,
        return_dict=False,
    )
    x = torch.tensor([ids])
    with torch.no_grad():
        log_t = torch.log_softmax(teacher(x).logits, -1)
        log_s = torch.log_softmax(student(x).logits, -1)
    reverse_kl = (log_s.exp() * (log_s - log_t)).sum(-1).mean().item()
    assert reverse_kl > 0.5, reverse_kl
    # planned with its built shape
    shape, where = shape_of(
        OmegaConf.create(
            {
                **OmegaConf.to_container(compose_config(["model=smollm2_student"]).model),
                "cache_dir": str(student_dir.parent),
            }
        )
    )
    assert shape.layers == 8 and where == str(student_dir / "config.json")


def test_more_layers_than_the_model_has_are_refused_before_ray(smollm2_path, tmp_path):
    with pytest.raises(StudentLayersError, match=r"model.layers=31: .* has 30 decoder layers; use 1..30"):
        keep_first_layers(Path(smollm2_path), tmp_path / "out", 31)
    assert not (tmp_path / "out").exists()
    cfg = compose_config(["model=smollm2_student", "model.layers=31"])
    with pytest.raises(InputError, match=r"^model.layers=31: .* has 30 decoder layers"):  # one line, exit 2
        prepare_inputs(cfg, OmegaConf.to_object(cfg))


def test_the_option_names_its_own_cache_entry_and_is_planned_with_its_layers(smollm2_path, tmp_path):
    # (a model cache of the test's own: a student built by an earlier run would be planned from its build)
    cfg = compose_config(["model=smollm2_student", f"model.cache_dir={tmp_path}"])
    model = instantiate(cfg.model)
    whole = gguf_model_id(cfg.model.distribution, cfg.model.version, cfg.model.gguf_file)
    assert model.whole().model_id == whole and model.model_id != whole and "first8layers" in model.model_id
    assert compose_config(["model=smollm2_135m"]).model.layers is None  # the whole model keeps its cache entry
    shape, where = shape_of(cfg.model)  # nothing built: the published config
    assert shape is not None and shape.layers == 8 and where.endswith("first 8 layers"), where
    (tmp_path / whole).symlink_to(smollm2_path)
    shape, where = shape_of(cfg.model)  # the whole model built: its config.json
    assert shape.layers == 8 and where == f"{tmp_path / whole / 'config.json'}, first 8 layers", where
    assert shape_of(compose_config(["model=smollm2_135m"]).model)[0].layers == 30
    with pytest.raises(InstantiationException, match=r"model.layers must be >= 1"):
        instantiate(compose_config(["model=smollm2_student", "model.layers=0"]).model)


def test_a_student_of_a_built_model_needs_neither_the_package_nor_the_converter(smollm2_path, tmp_path):
    """Checked before anything starts: a version of the package that is not installed is refused,
    unless the whole model of that version is in the cache (the student is cut from it)."""
    cfg = compose_config(["model=smollm2_student", "model.version=9.9.9", f"model.cache_dir={tmp_path}"])
    model = instantiate(cfg.model)
    with pytest.raises(ModelSourceError, match="model.version=9.9.9"):
        model.check()
    with pytest.raises(ModelSourceError, match="model.version=9.9.9"):
        check_packaged_gguf_option(cfg.model)
    (tmp_path / model.whole().model_id).symlink_to(smollm2_path)
    model.check()
    check_packaged_gguf_option(cfg.model)
