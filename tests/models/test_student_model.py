"""`model=smollm2_student`: SmolLM2-135M-Instruct's first decoder layers as a smaller student (the
teacher's embeddings, final norm, tied head, tokenizer and chat template), built from the teacher's
build in the model cache (`rlhf_orch.models.gguf.keep_first_layers`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from rlhf_orch.memory.shapes import shape_of
from rlhf_orch.orchestration.inputs import InputError, prepare_inputs
from rlhf_orch.models.gguf import StudentLayersError, keep_first_layers
from rlhf_orch.models.packaged import gguf_model_id
from tests.conftest import compose_config


@pytest.fixture(scope="module")
def student_dir(smollm2_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("student")
    keep_first_layers(Path(smollm2_path), out, 2)
    return out


def test_the_student_keeps_the_teachers_first_layers_embeddings_head_and_tokenizer(smollm2_path, student_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    teacher = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32)
    assert student.config.num_hidden_layers == 2 and teacher.config.num_hidden_layers == 30
    theirs = teacher.state_dict()
    mine = student.state_dict()
    assert set(mine) == {k for k in theirs if not k.startswith("model.layers.") or int(k.split(".")[2]) < 2}
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


def test_more_layers_than_the_model_has_are_refused_before_ray(smollm2_path, tmp_path):
    with pytest.raises(StudentLayersError, match=r"model.layers=31: .* has 30 decoder layers; use 1..30"):
        keep_first_layers(Path(smollm2_path), tmp_path / "out", 31)
    assert not (tmp_path / "out").exists()
    cfg = compose_config(["model=smollm2_student", "model.layers=31"])
    with pytest.raises(InputError, match=r"^model.layers=31: .* has 30 decoder layers"):  # one line, exit 2
        prepare_inputs(cfg, OmegaConf.to_object(cfg))


def test_the_option_names_its_own_cache_entry_and_is_planned_with_its_layers():
    cfg = compose_config(["model=smollm2_student"])
    model = instantiate(cfg.model)
    whole = gguf_model_id(cfg.model.distribution, cfg.model.version, cfg.model.gguf_file)
    assert model.whole().model_id == whole and model.model_id != whole and "first8layers" in model.model_id
    assert compose_config(["model=smollm2_135m"]).model.layers is None  # the whole model keeps its cache entry
    shape, where = shape_of(cfg.model)
    assert shape is not None and shape.layers == 8, where
    assert shape_of(compose_config(["model=smollm2_135m"]).model)[0].layers == 30
    with pytest.raises(InstantiationException, match=r"model.layers must be >= 1"):
        instantiate(compose_config(["model=smollm2_student", "model.layers=0"]).model)
