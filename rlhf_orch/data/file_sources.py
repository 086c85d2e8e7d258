"""Where data files are read from: local `.parquet` / `.jsonl` / `.json` files and hub datasets
`hf:<name>[:<config>]@<split>`, resolved and checked before Ray starts (`check_files`), then read as
rows through the `datasets` library (`read_rows`). Every bad input raises `DataError` naming the key.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from rlhf_orch.data.base import DataError

HUB_PREFIX = "hf:"
HUB_SPLIT_DEFAULT = "train"  # the split of a hub id written without `@<split>`
# File suffix -> the `datasets` packaged builder that reads it.
EXTENSIONS: dict[str, str] = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}
_HUB_PROBE_TIMEOUT_S = 2.5


# =========================================================================== file references
@dataclass(frozen=True)
class HubRef:
    """A hub dataset written `hf:<name>[:<config>]@<split>`."""

    name: str
    config: Optional[str]
    split: str
    spec: str  # as the user wrote it

    @staticmethod
    def parse(spec: str, key: str, default_split: str = HUB_SPLIT_DEFAULT) -> "HubRef":
        body = spec[len(HUB_PREFIX) :].strip()
        split = default_split
        if "@" in body:
            body, split = body.rsplit("@", 1)
        name, colon, config = body.partition(":")
        if not name or not split or name.count("/") > 1 or (colon and not config):
            raise DataError(
                f"{key}: cannot read hub dataset id {spec!r}; write hf:<name>[:<config>]@<split>, "
                f"e.g. hf:openai/gsm8k:main@train"
            )
        return HubRef(name=name, config=config or None, split=split, spec=spec)


@dataclass(frozen=True)
class ResolvedFile:
    """Where one entry of train_files/val_files is read from."""

    key: str  # e.g. "data.train_files[0]"
    spec: str  # as the user wrote it
    kind: str  # "local" | "hub" (online) | "hub_cache" (datasets cache, offline) | "hub_snapshot" (offline)
    path: Optional[str] = None  # local file, or the hub snapshot folder
    builder: Optional[str] = None  # "parquet" / "json" for local files
    hub: Optional[HubRef] = None


def as_file_list(files: Any, key: str) -> list[str]:
    """train_files/val_files as a list of strings (a single string is one file; None is none)."""
    if files is None:
        return []
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    try:
        items = list(files)
    except TypeError:
        raise DataError(f"{key}: expected a list of files, got {type(files).__name__} {files!r}") from None
    out = []
    for i, f in enumerate(items):
        if not isinstance(f, (str, os.PathLike)) or not str(f).strip():
            raise DataError(f"{key}[{i}]: expected a file path or hf:<name>[:<config>]@<split>, got {f!r}")
        out.append(os.fspath(f).strip())
    return out


def _columns_hint(columns: Optional[Sequence[str]]) -> str:
    cols = [c for c in (columns or ()) if c]
    if cols:
        return f"with columns {', '.join(cols)}"
    return "with the columns data.prompt_key and data.label_key name"


def resolve_file(spec: str, key: str, hub_split_default: str, columns: Optional[Sequence[str]]) -> ResolvedFile:
    base_key = key.split("[", 1)[0]
    if spec.startswith(HUB_PREFIX):
        ref = HubRef.parse(spec, key, hub_split_default)
        return _resolve_hub(ref, key, base_key, columns)
    path = Path(spec).expanduser()
    if not path.exists():
        where = "" if path.is_absolute() else f" (relative to the working directory {os.getcwd()})"
        raise DataError(f"{key}: no such file: {spec}{where}; fix the path in {base_key}")
    if path.is_dir():
        raise DataError(f"{key}: {spec} is a directory; list its .parquet/.jsonl/.json files in {base_key}")
    suffix = path.suffix.lower()
    if suffix not in EXTENSIONS:
        raise DataError(
            f"{key}: unknown file type {suffix or '(no extension)'!r} of {spec}; "
            f"use .parquet, .jsonl or .json files, or hf:<name>[:<config>]@<split>"
        )
    if not os.access(path, os.R_OK):
        raise DataError(f"{key}: {spec} is not readable (permissions); fix them or copy the file")
    return ResolvedFile(key=key, spec=spec, kind="local", path=str(path.resolve()), builder=EXTENSIONS[suffix])


# --------------------------------------------------------------------------- hub availability
def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _hub_endpoint() -> str:
    try:
        from huggingface_hub import constants

        return constants.ENDPOINT.rstrip("/")
    except Exception:  # pragma: no cover - huggingface_hub always ships with datasets
        return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


@functools.lru_cache(maxsize=None)
def _probe_endpoint(endpoint: str, timeout: float = _HUB_PROBE_TIMEOUT_S) -> bool:
    """One bounded HTTP request to the hub (any HTTP answer counts), once per process and endpoint.
    A thread bounds the DNS lookup too, which urllib's timeout does not cover."""
    result: list[bool] = []
    url = f"{endpoint}/"

    def probe() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
            result.append(True)
        except urllib.error.HTTPError:
            result.append(True)  # the hub answered (404, 401, ...): we are online
        except Exception:
            result.append(False)

    thread = threading.Thread(target=probe, name="hub-probe", daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    return bool(result and result[0])


def hub_offline() -> bool:
    """True when the hub must not or cannot be reached (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, or no answer)."""
    if _env_true("HF_HUB_OFFLINE") or _env_true("HF_DATASETS_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE"):
        return True
    try:
        from huggingface_hub import constants

        if constants.HF_HUB_OFFLINE:
            return True
    except Exception:  # pragma: no cover
        pass
    return not _probe_endpoint(_hub_endpoint())


def _hub_cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _datasets_cache_dir() -> str:
    import datasets.config

    return str(datasets.config.HF_DATASETS_CACHE)


def _in_datasets_cache(ref: HubRef) -> bool:
    """A prepared copy from an earlier `load_dataset` (the layout datasets' offline mode reads)."""
    from datasets.naming import camelcase_to_snakecase

    parts = ref.name.split("/")
    parts[-1] = camelcase_to_snakecase(parts[-1])
    root = os.path.join(os.path.expanduser(_datasets_cache_dir()), "___".join(parts))
    config = glob.escape(ref.config) if ref.config else "*"
    return any(os.path.isdir(p) for p in glob.glob(os.path.join(glob.escape(root), config, "*", "*")))


def _hub_snapshot(ref: HubRef) -> Optional[str]:
    """The local snapshot folder of the hub repo (`hf download --repo-type dataset`), without network."""
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(
            repo_id=ref.name, repo_type="dataset", local_files_only=True, cache_dir=_hub_cache_dir()
        )
    except Exception:
        return None
    return str(path) if path and os.path.isdir(path) else None


def _resolve_hub(ref: HubRef, key: str, base_key: str, columns: Optional[Sequence[str]]) -> ResolvedFile:
    if not hub_offline():
        return ResolvedFile(key=key, spec=ref.spec, kind="hub", hub=ref)
    if _in_datasets_cache(ref):
        return ResolvedFile(key=key, spec=ref.spec, kind="hub_cache", hub=ref)
    snapshot = _hub_snapshot(ref)
    if snapshot is not None:
        return ResolvedFile(key=key, spec=ref.spec, kind="hub_snapshot", hub=ref, path=snapshot)
    raise DataError(
        f"{key}: {ref.spec} is not in the local Hugging Face cache and this machine is offline; "
        f"download it where you have network (`hf download {ref.name} --repo-type dataset`, then copy "
        f"{_hub_cache_dir()} to the same place here, or set HF_HOME) or point {base_key} at a local "
        f"copy (parquet or jsonl {_columns_hint(columns)})"
    )


def check_files(
    files: Sequence[str],
    key: str,
    *,
    hub_split_default: str = HUB_SPLIT_DEFAULT,
    columns: Optional[Sequence[str]] = None,
) -> None:
    """Quick availability check (run before Ray starts): local files exist with a known extension, hub
    ids are reachable or cached. Reads no data. Raises DataError naming `<key>[i]`.

    `columns` only improves the offline message (the columns a local copy must have).
    """
    for i, spec in enumerate(as_file_list(files, key)):
        resolve_file(spec, f"{key}[{i}]", hub_split_default, columns)


# =========================================================================== reading rows
@contextlib.contextmanager
def _forced_offline() -> Iterator[None]:
    """datasets and huggingface_hub read their offline flags at import; flip them for one load."""
    import datasets.config as dconfig
    from huggingface_hub import constants as hconstants

    saved = (dconfig.HF_HUB_OFFLINE, getattr(dconfig, "HF_DATASETS_OFFLINE", None), hconstants.HF_HUB_OFFLINE)
    dconfig.HF_HUB_OFFLINE = True
    if hasattr(dconfig, "HF_DATASETS_OFFLINE"):
        dconfig.HF_DATASETS_OFFLINE = True
    hconstants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        dconfig.HF_HUB_OFFLINE = saved[0]
        if saved[1] is not None:
            dconfig.HF_DATASETS_OFFLINE = saved[1]
        hconstants.HF_HUB_OFFLINE = saved[2]


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def read_rows(src: ResolvedFile) -> list[dict]:
    """All rows of one file or hub split, as plain dicts (through the `datasets` library)."""
    import datasets

    try:
        if src.kind == "local":
            if os.path.getsize(src.path) == 0:
                return []
            # Streaming reads the file directly: no Arrow copy in the datasets cache.
            return _rows(datasets.load_dataset(src.builder, data_files=src.path, split="train", streaming=True))
        ref = src.hub
        if src.kind == "hub_snapshot":
            return _rows(datasets.load_dataset(src.path, ref.config, split=ref.split, streaming=True))
        if src.kind == "hub_cache":
            with _forced_offline():
                return _rows(datasets.load_dataset(ref.name, ref.config, split=ref.split))
        return _rows(datasets.load_dataset(ref.name, ref.config, split=ref.split))
    except DataError:
        raise
    except Exception as exc:
        base_key = src.key.split("[", 1)[0]
        if src.kind == "local":
            raise DataError(
                f"{src.key}: cannot read {src.spec} as {src.builder} ({one_line(exc)}); "
                f"fix or replace the file in {base_key}"
            ) from None
        ref = src.hub
        raise DataError(
            f"{src.key}: cannot load {src.spec} (name {ref.name!r}, config {ref.config!r}, split "
            f"{ref.split!r}; {one_line(exc)}); check the id, config and split, or point {base_key} at a "
            f"local copy"
        ) from None


def local_column_values(spec: str, key: str, column: str) -> Optional[set[Any]]:
    """The distinct values of the top-level `column` of one local data file, read before Ray (a
    parquet file's column alone, without its rows); None for a hub dataset or a file that cannot be
    read here (the data preparation reads it, and reports what is wrong with it)."""
    if spec.startswith(HUB_PREFIX):
        return None
    try:
        src = resolve_file(spec, key, "train", None)
        if src.builder == "parquet":
            import pyarrow.parquet as pq

            if column not in pq.ParquetFile(src.path).schema_arrow.names:
                return set()
            values = pq.read_table(src.path, columns=[column]).column(column).unique().to_pylist()
        else:
            values = [row.get(column) for row in read_rows(src)]
        return {v for v in values if v is not None}
    except Exception:  # the data preparation says what is wrong with the file
        return None


def _rows(ds: Any, batch_size: int = 1024) -> list[dict]:
    """Rows of a (streaming) dataset as dicts; batched, which is several times faster than row by row."""
    out: list[dict] = []
    for batch in ds.iter(batch_size=batch_size):
        keys = list(batch.keys())
        out.extend(dict(zip(keys, values)) for values in zip(*batch.values()))
    return out
