"""PromptDataset (data=files): real file formats written here, a tiny local tokenizer, no downloads."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from rlhf_orch.data.base import DataError, Prompt, PromptSource
from rlhf_orch.data.file_sources import check_files
from rlhf_orch.data.files import PromptDataset

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
WORDS = (
    "<s> </s> <pad> <unk> <user> <system> <assistant> what is 1 + 2 3 4 5 6 7 ? think step by step "
    "be brief q0 q1 q2 q3 q4 q5 q6 q7 q8 q9 a b long word"
).split()


def _tokenizer(chat_template: bool = True) -> PreTrainedTokenizerFast:
    """Word-level: one token per whitespace-separated word (unknown words are <unk>), BOS in front."""
    tk = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    if chat_template:
        tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def tok():
    return _tokenizer()


@pytest.fixture(autouse=True)
def _datasets_cache_in_tmp(tmp_path, monkeypatch):
    """Keep the datasets library's cache (lock files, prepared copies) out of the user's home."""
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets_cache")


# --------------------------------------------------------------------------- writers
def write_parquet(path: Path, rows: list[dict]) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def verl_rows(n: int, split: str = "train") -> list[dict]:
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"what is {i} + 2 ?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 2)},
            "extra_info": {"index": i, "split": split},
        }
        for i in range(n)
    ]


def make(files, **kw) -> PromptDataset:
    kw.setdefault("prompt_max_len", 64)
    kw.setdefault("response_max_len", 16)
    return PromptDataset(train_files=files, **kw)


def assert_one_line_error(exc_info, key: str) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg, msg
    assert msg.startswith(key), msg
    return msg


# --------------------------------------------------------------------------- formats
def test_verl_parquet_with_default_mapping(tmp_path, tok):
    train = write_parquet(tmp_path / "train.parquet", verl_rows(6))
    val = write_parquet(tmp_path / "test.parquet", verl_rows(3, "test"))
    ds = make([train], val_files=[val], shuffle=False)
    assert isinstance(ds, PromptSource)
    ds.bind(tok)
    assert ds.num_train_prompts == 6 and ds.label_column_present and ds.missing_labels() == 0
    p = ds.sample_prompts(1)[0]
    assert isinstance(p, Prompt)
    assert p.text == "<user> what is 0 + 2 ? <assistant>"
    assert p.label == "2"
    assert p.source == "openai/gsm8k"
    assert p.extra == {"index": 0, "split": "train"}
    # The chat template carries its own BOS: tokenized without special tokens.
    assert p.prompt_ids == tuple(tok(p.text, add_special_tokens=False).input_ids)
    assert p.prompt_ids[0] != tok.bos_token_id and all(isinstance(t, int) for t in p.prompt_ids)
    evals = ds.eval_prompts()
    assert [e.extra["index"] for e in evals] == [0, 1, 2] and evals[2].label == "4"
    assert [e.extra["index"] for e in ds.eval_prompts(limit=2)] == [0, 1]
    assert ds.filtered_overlong == {"train": 0, "val": 0}
    lines = ds.describe()
    assert lines[0].startswith("train: 6 prompts from") and lines[1].startswith("val: 3 prompts from")
    assert all("\n" not in line for line in lines)


def test_openrlhf_jsonl_with_prompt_and_label_keys(tmp_path, tok):
    f = write_jsonl(tmp_path / "d.jsonl", [{"input": f"q{i}", "label": str(i)} for i in range(4)])
    ds = make([f], prompt_key="input", label_key="label", default_source="mine", shuffle=False)
    ds.bind(tok)
    ps = ds.sample_prompts(4)
    assert [p.text for p in ps] == [f"<user> q{i} <assistant>" for i in range(4)]
    assert [p.label for p in ps] == ["0", "1", "2", "3"]
    assert {p.source for p in ps} == {"mine"} and all(p.extra is None for p in ps)
    assert ds.eval_prompts() == []


def test_json_list_and_json_lines(tmp_path, tok):
    as_list = tmp_path / "list.json"
    as_list.write_text(json.dumps([{"input": "a", "label": 1}, {"input": "b", "label": 2}]))
    as_lines = write_jsonl(tmp_path / "lines.json", [{"input": "q3", "label": 3}])
    ds = make([str(as_list), as_lines], prompt_key="input", label_key="label", shuffle=False)
    ds.bind(tok)
    assert [(p.text, p.label) for p in ds.sample_prompts(3)] == [
        ("<user> a <assistant>", 1),
        ("<user> b <assistant>", 2),
        ("<user> q3 <assistant>", 3),
    ]


def test_nested_label_key_and_label_regex(tmp_path, tok):
    rows = [{"q": "q1", "meta": {"answer": {"value": "so #### 1,234"}}}, {"q": "q2", "meta": {"answer": None}}]
    f = write_jsonl(tmp_path / "n.jsonl", rows)
    ds = make([f], prompt_key="q", label_key="meta.answer.value", shuffle=False)
    ds.bind(tok)
    assert [p.label for p in ds.sample_prompts(2)] == ["so #### 1,234", None]
    assert ds.missing_labels() == 1
    ds = make([f], prompt_key="q", label_key="meta.answer.value", label_regex=r"####\s*(-?[0-9.,]+)", shuffle=False)
    ds.bind(tok)
    assert ds.sample_prompts(1)[0].label == "1,234"


def test_prompt_template_plain_chat_and_columns(tmp_path, tok):
    plain = write_jsonl(tmp_path / "p.jsonl", [{"question": "what is 1 + 2 ?", "answer": "3"}])
    ds = make(
        [plain], prompt_key="question", label_key="answer", prompt_template="{prompt} think step by step \\boxed{{}}"
    )
    ds.bind(tok)
    assert ds.sample_prompts(1)[0].text == "<user> what is 1 + 2 ? think step by step \\boxed{} <assistant>"

    chat = write_parquet(tmp_path / "c.parquet", verl_rows(1))
    ds = make([chat], prompt_template="{prompt} be brief")
    ds.bind(tok)
    assert ds.sample_prompts(1)[0].text == "<user> what is 0 + 2 ? be brief <assistant>"

    # Countdown style: no prompt column, the template builds the prompt; the label is several columns.
    cd = write_parquet(tmp_path / "cd.parquet", [{"target": 7, "nums": [3, 4]}])
    ds = make(
        [cd],
        prompt_key=None,
        label_key=None,
        label_columns=["target", "nums"],
        chat_template=False,
        prompt_template="use {nums} to make {target}",
    )
    ds.bind(tok)
    p = ds.sample_prompts(1)[0]
    assert p.text == "use [3, 4] to make 7" and p.label == {"target": 7, "nums": [3, 4]}
    assert p.prompt_ids[0] == tok.bos_token_id


def test_chat_template_false_and_system_prompt(tmp_path, tok):
    rows = [
        {
            "prompt": [
                {"role": "user", "content": "what is"},
                {"role": "assistant", "content": "3"},
                {"role": "user", "content": "1 + 2 ?"},
            ],
            "reward_model": {"ground_truth": "3"},
        }
    ]
    f = write_parquet(tmp_path / "chat.parquet", rows)
    ds = make([f], chat_template=False)
    ds.bind(tok)
    p = ds.sample_prompts(1)[0]
    assert p.text == "what is\n3\n1 + 2 ?"
    assert p.prompt_ids == tuple(tok(p.text).input_ids) and p.prompt_ids[0] == tok.bos_token_id

    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "what is 1 + 2 ?"}])
    ds = make([plain], chat_template=False, system_prompt="be brief")
    ds.bind(tok)
    assert ds.sample_prompts(1)[0].text == "be brief\nwhat is 1 + 2 ?"
    assert not ds.label_column_present and ds.missing_labels() == 1

    ds = make([plain], system_prompt="be brief")
    ds.bind(tok)
    assert ds.sample_prompts(1)[0].text == "<system> be brief <user> what is 1 + 2 ? <assistant>"


# --------------------------------------------------------------------------- overlong
def _lengths_file(tmp_path) -> str:
    # Chat-templated lengths: 2 + words (<user> ... <assistant>).
    rows = [{"input": " ".join(["long"] * n), "label": str(n)} for n in (1, 9, 2, 12, 3)]
    return write_jsonl(tmp_path / "len.jsonl", rows)


def test_overlong_error_names_file_row_length_and_fix(tmp_path, tok):
    f = _lengths_file(tmp_path)
    ds = make([f], prompt_key="input", label_key="label", prompt_max_len=8)
    with pytest.raises(DataError) as e:
        ds.bind(tok)
    msg = assert_one_line_error(e, "data.prompt_max_len")
    assert "row 1" in msg and f in msg and "11 tokens" in msg and "data.overlong=filter" in msg


def test_overlong_filter_counts_train_and_val(tmp_path, tok):
    f = _lengths_file(tmp_path)
    v = write_jsonl(tmp_path / "val.jsonl", [{"input": "long " * 20, "label": "x"}, {"input": "a", "label": "y"}])
    ds = make([f], val_files=[v], prompt_key="input", label_key="label", prompt_max_len=8, overlong="filter")
    ds.bind(tok)
    assert ds.filtered_overlong == {"train": 2, "val": 1}
    assert "2 dropped as longer than data.prompt_max_len=8" in ds.describe()[0]
    assert ds.num_train_prompts == 3
    assert sorted(p.label for p in ds.sample_prompts(3)) == ["1", "2", "3"]
    assert [p.label for p in ds.eval_prompts()] == ["y"]

    ds = make([f], prompt_key="input", label_key="label", prompt_max_len=2, overlong="filter")
    with pytest.raises(DataError) as e:
        ds.bind(tok)
    msg = assert_one_line_error(e, "data.prompt_max_len")
    assert "every one of the 5" in msg


# --------------------------------------------------------------------------- bad input
def test_missing_file(tmp_path, tok):
    with pytest.raises(DataError) as e:
        make([str(tmp_path / "nope.parquet")]).bind(tok)
    assert "no such file" in assert_one_line_error(e, "data.train_files[0]: no such file")
    ok = write_parquet(tmp_path / "ok.parquet", verl_rows(2))
    with pytest.raises(DataError) as e:
        make([ok], val_files=[ok, str(tmp_path / "gone.jsonl")]).bind(tok)
    assert_one_line_error(e, "data.val_files[1]: no such file")
    with pytest.raises(DataError) as e:
        check_files([ok, str(tmp_path / "x.jsonl")], "data.train_files")
    assert_one_line_error(e, "data.train_files[1]")


def test_garbage_parquet(tmp_path, tok):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"this is not a parquet file at all")
    check_files([str(bad)], "data.train_files")  # exists: the quick check does not read it
    with pytest.raises(DataError) as e:
        make([str(bad)]).bind(tok)
    msg = assert_one_line_error(e, "data.train_files[0]")
    assert "cannot read" in msg and "bad.parquet" in msg


def test_missing_prompt_column_names_file_columns_and_key(tmp_path, tok):
    f = write_jsonl(tmp_path / "d.jsonl", [{"input": "q1", "label": "1"}])
    with pytest.raises(DataError) as e:
        make([f]).bind(tok)
    msg = assert_one_line_error(e, "data.prompt_key")
    assert "'prompt'" in msg and f in msg and "input, label" in msg


def test_label_column_absent_explicit_vs_default(tmp_path, tok):
    f = write_jsonl(tmp_path / "d.jsonl", [{"input": "q1", "answer": "1"}])
    with pytest.raises(DataError) as e:
        make([f], prompt_key="input", label_key="label").bind(tok)
    msg = assert_one_line_error(e, "data.label_key")
    assert "'label'" in msg and "answer, input" in msg
    ds = make([f], prompt_key="input")  # default label key absent: no labels, no error
    ds.bind(tok)
    assert not ds.label_column_present and ds.missing_labels() == 1
    assert ds.sample_prompts(1)[0].label is None


def test_empty_datasets(tmp_path, tok):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError) as e:
        make([str(empty)]).bind(tok)
    assert "0 rows" in assert_one_line_error(e, "data.train_files[0]")
    empty_list = tmp_path / "empty.json"
    empty_list.write_text("[]")
    with pytest.raises(DataError) as e:
        make([str(empty_list)]).bind(tok)
    assert_one_line_error(e, "data.train_files[0]")
    with pytest.raises(DataError) as e:
        make([])
    assert_one_line_error(e, "data.train_files")


def test_unknown_extension(tmp_path, tok):
    f = tmp_path / "d.csv"
    f.write_text("prompt\nq1\n")
    with pytest.raises(DataError) as e:
        make([str(f)]).bind(tok)
    assert ".csv" in assert_one_line_error(e, "data.train_files[0]")


def test_bad_options(tmp_path):
    f = str(tmp_path / "whatever.jsonl")
    with pytest.raises(DataError) as e:
        make([f], overlong="truncate")
    assert "error, filter" in assert_one_line_error(e, "data.overlong")
    with pytest.raises(DataError) as e:
        make([f], prompt_template="Solve this")
    assert "{prompt}" in assert_one_line_error(e, "data.prompt_template")
    with pytest.raises(DataError) as e:
        make([f], prompt_template="{prompt} \\boxed{}")  # unescaped braces
    assert_one_line_error(e, "data.prompt_template")
    with pytest.raises(DataError) as e:
        make([f], prompt_key=None)
    assert_one_line_error(e, "data.prompt_template")
    with pytest.raises(DataError) as e:
        make([f], prompt_max_len=0)
    assert_one_line_error(e, "data.prompt_max_len")


def test_tokenizer_without_chat_template(tmp_path):
    f = write_parquet(tmp_path / "d.parquet", verl_rows(2))
    with pytest.raises(DataError) as e:
        make([f]).bind(_tokenizer(chat_template=False))
    assert "chat_template=false" in assert_one_line_error(e, "data.chat_template")
    ds = make([f], chat_template=False)
    ds.bind(_tokenizer(chat_template=False))
    assert ds.sample_prompts(1)[0].text.startswith("what is")


# --------------------------------------------------------------------------- sampling state
def test_dataset_state_round_trip_continues_identically(tmp_path, tok):
    f = write_parquet(tmp_path / "d.parquet", verl_rows(7))
    a = make([f], seed=5)
    a.bind(tok)
    first = a.sample_prompts(5)
    assert len({p.extra["index"] for p in first}) == 5  # no repeats inside the epoch
    state = json.loads(json.dumps(a.state_dict()))
    expected = [p.extra["index"] for p in a.sample_prompts(12)]

    b = make([f], seed=5)
    b.bind(tok)
    b.load_state_dict(state)
    assert [p.extra["index"] for p in b.sample_prompts(12)] == expected

    c = make([f], seed=5)  # state loaded before bind is applied by bind
    c.load_state_dict(state)
    c.bind(tok)
    assert [p.extra["index"] for p in c.sample_prompts(12)] == expected

    other_seed = make([f], seed=6)
    other_seed.bind(tok)
    assert [p.extra["index"] for p in other_seed.sample_prompts(7)] != [p.extra["index"] for p in first] + expected[:2]


def test_unbound_use_is_an_error(tmp_path):
    ds = make([str(tmp_path / "d.parquet")])
    with pytest.raises(RuntimeError):
        ds.sample_prompts(1)
    assert ds.state_dict() == {"consumed": 0}


# --------------------------------------------------------------------------- hub ids
def test_hub_id_offline_and_not_cached_fails_fast(tmp_path, tok, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    spec = "hf:rlhf-orch-tests/no-such-dataset:main@train"
    start = time.monotonic()
    with pytest.raises(DataError) as e:
        check_files([spec], "data.train_files")
    msg = assert_one_line_error(e, f"data.train_files[0]: {spec} is not in the local Hugging Face cache")
    assert "offline" in msg and "point data.train_files at a local copy" in msg
    with pytest.raises(DataError) as e:
        make([spec]).bind(tok)
    assert_one_line_error(e, "data.train_files[0]")
    assert time.monotonic() - start < 5.0


def test_hub_id_offline_read_from_a_cached_snapshot(tmp_path, tok, monkeypatch):
    """A repo fetched with `hf download --repo-type dataset` (the hub cache layout) loads offline."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub = tmp_path / "hub"
    repo = hub / "datasets--some-org--tiny-math"
    sha = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(sha)
    data = repo / "snapshots" / sha / "data"
    data.mkdir(parents=True)
    write_parquet(data / "train-00000-of-00001.parquet", verl_rows(3))
    write_parquet(data / "test-00000-of-00001.parquet", verl_rows(2, "test"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))

    ds = make(["hf:some-org/tiny-math"], val_files=["hf:some-org/tiny-math@test"], shuffle=False)
    ds.bind(tok)
    assert ds.num_train_prompts == 3
    assert [p.extra["split"] for p in ds.eval_prompts()] == ["test", "test"]


def test_hub_id_offline_read_from_the_datasets_cache(tmp_path, tok, monkeypatch):
    """A dataset prepared by an earlier online `load_dataset` (the datasets cache) loads offline.

    The cache entry is made here the way datasets lays it out: <cache>/<org>___<name>/<config>/<version>/<hash>/
    with <name>-<split>.arrow files and a dataset_info.json naming the config (built from a local parquet)."""
    import shutil

    import datasets
    import datasets.config

    src = write_parquet(tmp_path / "src.parquet", verl_rows(4))
    prep = tmp_path / "prep"
    datasets.load_dataset("parquet", data_files={"train": src}, cache_dir=str(prep))
    built = next(p for p in (prep / "parquet").glob("*/*/*") if p.is_dir())
    entry = Path(datasets.config.HF_DATASETS_CACHE) / "some-org___tiny-math" / "main" / "0.0.0" / built.name
    shutil.copytree(built, entry)
    for f in entry.glob("parquet-*.arrow"):
        f.rename(entry / f.name.replace("parquet-", "tiny-math-", 1))
    info = json.loads((entry / "dataset_info.json").read_text())
    info.update(config_name="main", dataset_name="tiny-math")
    (entry / "dataset_info.json").write_text(json.dumps(info))

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # set after import: the flags datasets read are flipped per load
    ds = make(["hf:some-org/tiny-math:main@train"], shuffle=False)
    ds.bind(tok)
    assert ds.num_train_prompts == 4
    assert ds.sample_prompts(1)[0].label == "2"
