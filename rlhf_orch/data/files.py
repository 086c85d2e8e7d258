"""Prompts from files: local `.parquet` / `.jsonl` / `.json`, or hub datasets `hf:<name>[:<config>]@<split>`.

`PromptDataset` is the `_target_` of `data=files` and of the named datasets (gsm8k, math, ...). Every
constructor argument is a config key `data.<name>`; every bad input raises `DataError` with one line
naming that key and the fix. Finding the files (local or hub, cached or offline) and reading their
rows is `rlhf_orch.data.file_sources`; this file maps columns, templates, tokenizes and samples.

Column mapping. The defaults read veRL's parquet layout as is: `data_source` (str), `prompt` (chat
messages, a list of `{"role", "content"}`), `reward_model` (`{"style", "ground_truth"}`), `extra_info`
(dict). OpenRLHF's jsonl layout (`{"input": ..., "label": ...}`) takes `prompt_key=input
label_key=label`. Dots in a key read nested fields (`reward_model.ground_truth`). A prompt column
holding a string is a plain prompt; one holding a list of messages is a chat.

Templating, in order:
  1. `prompt_template` (a `str.format` template: `{prompt}` is the plain prompt, or the content of the
     last user message of a chat; any top-level column can be used as `{column}`; write literal braces
     as `{{ }}`). With `prompt_key=null` the template alone builds the prompt from columns.
  2. `chat_template=True`: a plain prompt becomes one user message (after `system_prompt` as a system
     message, if given; a chat gets it prepended unless it has a system message already), rendered with
     `tokenizer.apply_chat_template(..., add_generation_prompt=True, tokenize=False)` and tokenized with
     `add_special_tokens=False` (the template carries its own BOS).
     `chat_template=False`: a chat's contents are joined with newlines, `system_prompt` (if given) goes
     first on its own line, and the text is tokenized normally (the tokenizer adds its BOS).

Rows are tokenized once in `bind` and kept as compact columns (texts, labels, one flat int32 array of
ids); `Prompt` objects are built only for the prompts handed out.
"""

from __future__ import annotations

import logging
import re
import string
import sys
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from rlhf_orch.data.base import ALL_PROMPTS, DEFAULT_DATA_SEED, DataError, Prompt, PromptSource
from rlhf_orch.data.file_sources import HUB_SPLIT_DEFAULT, ResolvedFile, as_file_list, one_line, read_rows, resolve_file
from rlhf_orch.data.options import FilesDataConfig
from rlhf_orch.data.sampler import EpochSampler

logger = logging.getLogger(__name__)

OVERLONG_POLICIES = ("error", "filter")
DEFAULT_LABEL_KEY = FilesDataConfig.label_key
_TOKENIZE_CHUNK = 1024


_MISSING = object()


def _lookup(row: Mapping[str, Any], key: str) -> Any:
    """row[key], reading dotted keys as nested fields; _MISSING when absent."""
    if key in row:
        return row[key]
    cur: Any = row
    for part in key.split("."):
        if isinstance(cur, Mapping) and part in cur:
            cur = cur[part]
        else:
            return _MISSING
    return cur


def _has_column(columns: set[str], key: str) -> bool:
    return key in columns or key.split(".", 1)[0] in columns


def _is_chat(value: Any) -> bool:
    return (
        isinstance(value, (list, tuple))
        and len(value) > 0
        and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in value)
    )


# =========================================================================== compact storage
class _Split:
    """One split after tokenization: columns, with ids in one flat int32 array."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.labels: list[Any] = []
        self.sources: list[str] = []
        self.extras: list[Optional[dict]] = []
        # Multi-turn environments start from a row's chat messages and read its env fields
        # (SkyRL's layout); None for rows without them.
        self.messages: list[Optional[tuple]] = []
        self.env_fields: list[Optional[dict]] = []
        self._ids_chunks: list[np.ndarray] = []
        self._lengths: list[int] = []
        self.ids = np.zeros(0, dtype=np.int32)
        self.offsets = np.zeros(1, dtype=np.int64)

    def add(
        self,
        text: str,
        label: Any,
        source: str,
        extra: Optional[dict],
        ids: Sequence[int],
        messages: Optional[tuple] = None,
        env_fields: Optional[dict] = None,
    ) -> None:
        self.messages.append(messages)
        self.env_fields.append(env_fields)
        self.texts.append(text)
        self.labels.append(label)
        self.sources.append(source)
        self.extras.append(extra)
        self._ids_chunks.append(np.asarray(ids, dtype=np.int32))
        self._lengths.append(len(ids))

    def finish(self) -> None:
        self.ids = np.concatenate(self._ids_chunks) if self._ids_chunks else np.zeros(0, dtype=np.int32)
        self.offsets = np.zeros(len(self._lengths) + 1, dtype=np.int64)
        np.cumsum(self._lengths, out=self.offsets[1:])
        self._ids_chunks, self._lengths = [], []

    def __len__(self) -> int:
        return len(self.texts)

    def prompt(self, i: int) -> Prompt:
        ids = self.ids[self.offsets[i] : self.offsets[i + 1]]
        return Prompt(
            text=self.texts[i],
            label=self.labels[i],
            source=self.sources[i],
            extra=self.extras[i],
            prompt_ids=tuple(int(t) for t in ids),
            messages=self.messages[i],
            env_fields=self.env_fields[i],
        )


# =========================================================================== the dataset
class PromptDataset(PromptSource):
    """Prompts read from files or hub datasets, templated and tokenized once in `bind`."""

    def __init__(
        self,
        train_files: Sequence[str] = (),
        val_files: Optional[Sequence[str]] = None,
        prompt_key: Optional[str] = FilesDataConfig.prompt_key,
        label_key: Optional[str] = DEFAULT_LABEL_KEY,
        source_key: Optional[str] = FilesDataConfig.source_key,
        default_source: str = FilesDataConfig.default_source,
        extra_key: Optional[str] = FilesDataConfig.extra_key,
        chat_template: bool = True,
        prompt_template: Optional[str] = None,
        system_prompt: Optional[str] = None,
        overlong: str = FilesDataConfig.overlong,
        shuffle: bool = True,
        seed: int = DEFAULT_DATA_SEED,
        prompt_max_len: int = FilesDataConfig.prompt_max_len,
        response_max_len: int = FilesDataConfig.response_max_len,
        hub_split_default: str = HUB_SPLIT_DEFAULT,
        label_regex: Optional[str] = None,
        label_columns: Optional[Sequence[str]] = None,
    ):
        self.train_files = as_file_list(train_files, "data.train_files")
        self.val_files = as_file_list(val_files, "data.val_files")
        if not self.train_files:
            raise DataError(
                "data.train_files: is empty; set data.train_files=[/path/train.parquet] "
                "(.parquet, .jsonl, .json or hf:<name>[:<config>]@<split>)"
            )
        for name, value in (
            ("prompt_key", prompt_key),
            ("label_key", label_key),
            ("source_key", source_key),
            ("extra_key", extra_key),
        ):
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise DataError(f"data.{name}: expected a column name or null, got {value!r}")
        self.prompt_key = prompt_key
        self.label_key = label_key
        self.source_key = source_key
        self.default_source = str(default_source)
        self.extra_key = extra_key
        self.chat_template = bool(chat_template)
        self.system_prompt = system_prompt
        if overlong not in OVERLONG_POLICIES:
            raise DataError(
                f"data.overlong: {overlong!r} is not one of error, filter; "
                f"set data.overlong=error or data.overlong=filter"
            )
        self.overlong = overlong
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        for name, value in (("prompt_max_len", prompt_max_len), ("response_max_len", response_max_len)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise DataError(f"data.{name}: must be a positive number of tokens, got {value!r}")
        self.prompt_max_len = int(prompt_max_len)
        self.response_max_len = int(response_max_len)
        if not isinstance(hub_split_default, str) or not hub_split_default:
            raise DataError(f"data.hub_split_default: expected a split name such as train, got {hub_split_default!r}")
        self.hub_split_default = hub_split_default

        self.prompt_template = prompt_template
        self._template_fields = self._check_template(prompt_template, prompt_key)

        self.label_columns = list(label_columns) if label_columns is not None else None
        if self.label_columns is not None:
            if not self.label_columns or not all(isinstance(c, str) and c for c in self.label_columns):
                raise DataError(f"data.label_columns: expected a non-empty list of column names, got {label_columns!r}")
            if label_key is not None and label_key != DEFAULT_LABEL_KEY:
                raise DataError(
                    "data.label_key: set together with data.label_columns; set data.label_key=null to use the columns"
                )
            if label_regex is not None:
                raise DataError(
                    "data.label_regex: applies to data.label_key only; remove it or set data.label_columns=null"
                )
        self.label_regex = label_regex
        self._label_re = None
        if label_regex is not None:
            try:
                self._label_re = re.compile(label_regex)
            except (re.error, TypeError) as exc:
                raise DataError(
                    f"data.label_regex: {label_regex!r} is not a valid regular expression ({exc})"
                ) from None

        # Filled by bind().
        self.filtered_overlong: dict[str, int] = {"train": 0, "val": 0}
        self.label_column_present: bool = False
        self._train: Optional[_Split] = None
        self._val: Optional[_Split] = None
        self._sampler: Optional[EpochSampler] = None
        self._pending_state: Optional[dict] = None

    # ------------------------------------------------------------------ config checks
    @staticmethod
    def _check_template(template: Optional[str], prompt_key: Optional[str]) -> set[str]:
        if template is None:
            if prompt_key is None:
                raise DataError(
                    "data.prompt_template: data.prompt_key is null, so a template must build the prompt "
                    "from columns, e.g. data.prompt_template='Solve {question}'"
                )
            return set()
        if not isinstance(template, str):
            raise DataError(f"data.prompt_template: expected a string with {{prompt}}, got {template!r}")
        try:
            parsed = list(string.Formatter().parse(template))
        except ValueError as exc:
            raise DataError(
                f"data.prompt_template: {exc} in {template!r}; write literal braces as {{{{ and }}}}"
            ) from None
        fields = set()
        for _, field, _, _ in parsed:
            if field is None:
                continue
            base = re.split(r"[.\[]", field, 1)[0]
            if not base or base.isdigit():
                raise DataError(
                    f"data.prompt_template: a positional field {{{field}}} in {template!r}; use {{prompt}} "
                    f"or {{column}}, and write literal braces as {{{{ and }}}}"
                )
            fields.add(base)
        if prompt_key is not None and "prompt" not in fields:
            raise DataError(
                f"data.prompt_template: {template!r} has no {{prompt}}; add {{prompt}} where the prompt goes"
            )
        return fields

    def _needed_columns(self) -> list[str]:
        cols = [self.prompt_key or ""]
        cols += self.label_columns if self.label_columns is not None else [self.label_key or ""]
        return [c for c in cols if c]

    # ------------------------------------------------------------------ bind
    def bind(self, tokenizer: Any) -> None:
        if self.chat_template and not getattr(tokenizer, "chat_template", None):
            model = getattr(tokenizer, "name_or_path", "") or "(in memory)"
            raise DataError(
                f"data.chat_template: the tokenizer of model {model} has no chat template; "
                f"set data.chat_template=false to tokenize prompts as plain text"
            )
        cols = self._needed_columns()
        split_default = self.hub_split_default
        train_src = [
            resolve_file(s, f"data.train_files[{i}]", split_default, cols) for i, s in enumerate(self.train_files)
        ]
        val_src = [resolve_file(s, f"data.val_files[{i}]", split_default, cols) for i, s in enumerate(self.val_files)]
        self.label_column_present = True
        self.filtered_overlong = {"train": 0, "val": 0}
        train = self._load_split(train_src, tokenizer, "train")
        val = self._load_split(val_src, tokenizer, "val") if val_src else _Split()
        self._train, self._val = train, val
        self._sampler = EpochSampler(len(train), self.seed, self.shuffle)
        if self._pending_state is not None:
            self._sampler.load_state_dict(self._pending_state)
            self._pending_state = None
        logger.info(
            "data: %d training prompts from %d file(s), %d held-out; filtered as overlong (> %d tokens): %s",
            len(train),
            len(train_src),
            len(val),
            self.prompt_max_len,
            self.filtered_overlong,
        )

    def _load_split(self, sources: list[ResolvedFile], tokenizer: Any, split: str) -> _Split:
        out = _Split()
        total = 0
        shortest_overlong: Optional[int] = None
        for src in sources:
            rows = read_rows(src)
            if not rows:
                raise DataError(
                    f"{src.key}: {src.spec} has 0 rows; point {src.key.split('[', 1)[0]} at a file with prompts"
                )
            built = self._build_rows(rows, src, tokenizer)
            for row_index, (text, label, source, extra, ids, messages, env_fields) in enumerate(built):
                total += 1
                if len(ids) > self.prompt_max_len:
                    if self.overlong == "error":
                        raise DataError(
                            f"data.prompt_max_len: row {row_index} of {src.spec} is {len(ids)} tokens, over "
                            f"data.prompt_max_len={self.prompt_max_len}; raise data.prompt_max_len or set "
                            f"data.overlong=filter to drop such prompts"
                        )
                    self.filtered_overlong[split] += 1
                    shortest_overlong = len(ids) if shortest_overlong is None else min(shortest_overlong, len(ids))
                    continue
                out.add(text, label, source, extra, ids, messages, env_fields)
        if total and not len(out):
            which = "training" if split == "train" else "held-out"
            raise DataError(
                f"data.prompt_max_len: every one of the {total} {which} prompts is longer than "
                f"data.prompt_max_len={self.prompt_max_len} tokens (the shortest is {shortest_overlong}); "
                f"raise data.prompt_max_len"
            )
        if self.filtered_overlong[split]:
            logger.warning(
                "data: dropped %d of %d %s prompts longer than data.prompt_max_len=%d tokens",
                self.filtered_overlong[split],
                total,
                split,
                self.prompt_max_len,
            )
        out.finish()
        return out

    def _build_rows(self, rows: list[dict], src: ResolvedFile, tokenizer: Any) -> list[tuple]:
        """(text, label, source, extra, ids) for each row of one file, in file order."""
        columns: set[str] = set()
        for r in rows:
            columns.update(r.keys())
        have = ", ".join(sorted(columns)) or "(none)"
        if self.prompt_key is not None and not _has_column(columns, self.prompt_key):
            raise DataError(
                f"data.prompt_key: column {self.prompt_key!r} is not in {src.spec} (its columns: {have}); "
                f"set data.prompt_key to the prompt column"
            )
        missing_fields = sorted(f for f in self._template_fields if f != "prompt" and f not in columns)
        if missing_fields:
            raise DataError(
                f"data.prompt_template: {{{missing_fields[0]}}} is not a column of {src.spec} (its columns: "
                f"{have}); use {{prompt}} or one of those columns"
            )
        label_mode = self._label_mode(columns, rows, src, have)

        texts: list[str] = []
        meta: list[tuple] = []
        for i, row in enumerate(rows):
            text, messages = self._render(row, i, src, tokenizer)
            texts.append(text)
            env_fields = self._env_fields(row)
            meta.append((self._label(row, label_mode), self._source(row), self._extra(row), messages, env_fields))
        ids = self._tokenize(texts, tokenizer)
        return [(t, m[0], m[1], m[2], x, m[3], m[4]) for t, m, x in zip(texts, meta, ids)]

    def _label_mode(self, columns: set[str], rows: list[dict], src: ResolvedFile, have: str) -> str:
        if self.label_columns is not None:
            absent = [c for c in self.label_columns if c not in columns]
            if absent:
                raise DataError(
                    f"data.label_columns: column {absent[0]!r} is not in {src.spec} (its columns: {have}); "
                    f"set data.label_columns to columns of the file"
                )
            return "columns"
        if self.label_key is None:
            self.label_column_present = False
            return "none"
        present = _has_column(columns, self.label_key) and any(_lookup(r, self.label_key) is not _MISSING for r in rows)
        if present:
            return "key"
        if self.label_key != DEFAULT_LABEL_KEY:
            raise DataError(
                f"data.label_key: column {self.label_key!r} is not in {src.spec} (its columns: {have}); set "
                f"data.label_key to the label column, or data.label_key=null for prompts without labels"
            )
        self.label_column_present = False
        logger.info("data: %s has no %r column; its prompts have no label", src.spec, self.label_key)
        return "none"

    def _label(self, row: Mapping[str, Any], mode: str) -> Any:
        if mode == "columns":
            return {c: row.get(c) for c in self.label_columns}
        if mode == "none":
            return None
        value = _lookup(row, self.label_key)
        if value is _MISSING or value is None:
            return None
        if self._label_re is not None:
            m = self._label_re.search(str(value))
            if m is None:
                return None
            return m.group(1) if m.re.groups else m.group(0)
        return value

    def _source(self, row: Mapping[str, Any]) -> str:
        if self.source_key is None:
            return self.default_source
        value = _lookup(row, self.source_key)
        # Interned: a handful of distinct sources repeated over every row.
        return self.default_source if value is _MISSING or value is None else sys.intern(str(value))

    def env_field_values(self, name: str) -> set[Any]:
        values = set()
        for split in (self._train, self._val):
            for fields in split.env_fields if split is not None else ():
                value = (fields or {}).get(name)
                if value is not None:
                    values.add(value)
        return values

    def _env_fields(self, row: Mapping[str, Any]) -> Optional[dict]:
        """What a row gives its environment (skyrl-gym's `extras`): every column but the prompt, as
        SkyRL's PromptDataset passes them (text2sql reads `db_id` and `data`, lcb its tests)."""
        prompt_column = self.prompt_key.split(".")[0] if self.prompt_key else None
        return {k: v for k, v in row.items() if k != prompt_column and v is not None} or None

    def _extra(self, row: Mapping[str, Any]) -> Optional[dict]:
        if self.extra_key is None:
            return None
        value = _lookup(row, self.extra_key)
        if value is _MISSING or value is None:
            return None
        return dict(value) if isinstance(value, Mapping) else {self.extra_key: value}

    def _render(self, row: Mapping[str, Any], i: int, src: ResolvedFile, tokenizer: Any) -> tuple[str, Optional[tuple]]:
        """The final text the policy is conditioned on (templated), and the chat messages it was
        rendered from (None for a plain prompt rendered without the chat template)."""
        messages: Optional[list[dict]] = None
        plain: Optional[str] = None
        if self.prompt_key is not None:
            value = _lookup(row, self.prompt_key)
            if isinstance(value, str):
                plain = value
            elif _is_chat(value):
                messages = [{"role": str(m["role"]), "content": str(m["content"] or "")} for m in value]
            else:
                got = "nothing" if value is _MISSING or value is None else type(value).__name__
                raise DataError(
                    f"data.prompt_key: row {i} of {src.spec} has {got} in column {self.prompt_key!r}; expected "
                    f"a string or a list of {{role, content}} messages (fix the row or set data.prompt_key)"
                )
        if self.prompt_template is not None:
            if messages is not None:
                target = self._last_user(messages)
                messages[target]["content"] = self._format(messages[target]["content"], row, i, src)
            else:
                plain = self._format(plain, row, i, src)

        if not self.chat_template:
            if messages is not None:
                has_system = any(m["role"] == "system" for m in messages)
                body = "\n".join(m["content"] for m in messages)
            else:
                has_system = False
                body = plain or ""
            text = f"{self.system_prompt}\n{body}" if self.system_prompt and not has_system else body
            return text, (tuple(messages) if messages is not None else None)

        if messages is None:
            messages = [{"role": "user", "content": plain or ""}]
        if self.system_prompt and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": self.system_prompt}] + messages
        try:
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **self.template_kwargs
            )
        except Exception as exc:
            raise DataError(
                f"data.chat_template: the chat template failed on row {i} of {src.spec} ({one_line(exc)}); "
                f"fix the row's messages or set data.chat_template=false"
            ) from None
        if isinstance(text, list):  # some versions answer a batch even for one conversation
            text = text[0]
        if not isinstance(text, str):
            raise DataError(
                f"data.chat_template: apply_chat_template(tokenize=False) returned {type(text).__name__}, not "
                f"text; set data.chat_template=false or use a tokenizer with a text chat template"
            )
        return text, tuple(messages)

    @staticmethod
    def _last_user(messages: list[dict]) -> int:
        for j in range(len(messages) - 1, -1, -1):
            if messages[j]["role"] == "user":
                return j
        return len(messages) - 1

    def _format(self, prompt: Optional[str], row: Mapping[str, Any], i: int, src: ResolvedFile) -> str:
        values = dict(row)
        values["prompt"] = prompt if prompt is not None else ""
        try:
            return self.prompt_template.format_map(values)
        except (KeyError, IndexError, AttributeError, ValueError, TypeError) as exc:
            raise DataError(
                f"data.prompt_template: cannot fill {self.prompt_template!r} for row {i} of {src.spec} "
                f"({one_line(exc)}); use {{prompt}} or {{column}}, literal braces as {{{{ and }}}}"
            ) from None

    def _tokenize(self, texts: list[str], tokenizer: Any) -> list[list[int]]:
        # A chat template writes its own BOS; plain text gets the tokenizer's special tokens.
        add_special = not self.chat_template
        out: list[list[int]] = []
        for start in range(0, len(texts), _TOKENIZE_CHUNK):
            chunk = texts[start : start + _TOKENIZE_CHUNK]
            out.extend(tokenizer(chunk, add_special_tokens=add_special)["input_ids"])
        return out

    # ------------------------------------------------------------------ PromptSource
    def _bound(self) -> tuple[_Split, _Split, EpochSampler]:
        if self._train is None or self._val is None or self._sampler is None:
            raise RuntimeError("PromptDataset: call bind(tokenizer) first")
        return self._train, self._val, self._sampler

    def sample_prompts(self, n: int) -> list[Prompt]:
        train, _, sampler = self._bound()
        return [train.prompt(i) for i in sampler.take(n)]

    def eval_prompts(self, limit: int = ALL_PROMPTS) -> list[Prompt]:
        if limit < 0:
            raise ValueError(f"eval_prompts(limit) needs limit >= 0, got {limit}")
        _, val, _ = self._bound()
        count = len(val) if limit == 0 else min(limit, len(val))
        return [val.prompt(i) for i in range(count)]

    def state_dict(self) -> dict:
        if self._sampler is None:
            return dict(self._pending_state or {"consumed": 0})
        return self._sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self._sampler is None:
            EpochSampler(1, 0).load_state_dict(state)  # validates
            self._pending_state = {"consumed": int(state["consumed"])}
            return
        self._sampler.load_state_dict(state)

    @property
    def num_train_prompts(self) -> int:
        train, _, _ = self._bound()
        return len(train)

    @property
    def num_val_prompts(self) -> int:
        _, val, _ = self._bound()
        return len(val)

    @property
    def epoch(self) -> int:
        return self._bound()[2].epoch

    def missing_labels(self) -> int:
        """Training prompts (after filtering) whose label is None."""
        train, _, _ = self._bound()
        return sum(1 for x in train.labels if x is None)

    def missing_val_labels(self) -> int:
        """Held-out prompts (after filtering) whose label is None."""
        _, val, _ = self._bound()
        return sum(1 for x in val.labels if x is None)

    def describe(self) -> list[str]:
        """Lines for the start of a run: prompts read and dropped, labels, templating, sampling."""
        train, val, _ = self._bound()
        lines = []
        for name, split, files in (("train", train, self.train_files), ("val", val, self.val_files)):
            if not files:
                lines.append(f"{name}: no held-out files (data.val_files=[])")
                continue
            lengths = np.diff(split.offsets)
            longest = int(lengths.max()) if len(lengths) else 0
            dropped = self.filtered_overlong[name]
            lines.append(
                f"{name}: {len(split)} prompts from {', '.join(files)}; longest {longest} tokens"
                + (f"; {dropped} dropped as longer than data.prompt_max_len={self.prompt_max_len}" if dropped else "")
            )
        if self.label_columns is not None:
            labels = f"columns {', '.join(self.label_columns)}"
        elif self.label_key is None:
            labels = "none (data.label_key=null)"
        else:
            labels = f"{self.label_key!r}" + (f" matched by {self.label_regex!r}" if self.label_regex else "")
        missing = self.missing_labels()
        lines.append(f"labels: {labels}" + (f"; {missing} training prompts have none" if missing else ""))
        template = "tokenizer chat template" if self.chat_template else "plain text"
        if self.prompt_template is not None:
            template = f"prompt_template, then {template}"
        order = f"shuffled per epoch (seed {self.seed})" if self.shuffle else "file order"
        lines.append(f"prompts: {template}; sampling {order}")
        return lines
