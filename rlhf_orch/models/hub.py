"""Model checkpoints named by a local directory or a hub id, resolved without the network.

A run must not discover after its actors started that a model cannot be loaded: a hub id is
resolved on the driver before Ray starts, from the local Hugging Face cache only (no download
attempt, so an offline machine answers at once).
"""

from __future__ import annotations

from pathlib import Path

from rlhf_orch.models.source_error import ModelSourceError


def looks_like_path(name_or_path: str) -> bool:
    return name_or_path.startswith(("/", "./", "../", "~")) or Path(name_or_path).expanduser().exists()


def resolve_local_checkpoint(name_or_path: str, key: str) -> str:
    """A local directory holding the checkpoint: the path itself, or the hub id's cached snapshot."""
    if looks_like_path(name_or_path):
        path = Path(name_or_path).expanduser()
        if not (path / "config.json").is_file():
            raise ModelSourceError(
                f"{key}={name_or_path!r}: no checkpoint there (no config.json); give a Hugging Face checkpoint directory"
            )
        return str(path)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(name_or_path, local_files_only=True)
    except (LocalEntryNotFoundError, ValueError, OSError) as e:
        raise ModelSourceError(
            f"{key}={name_or_path!r} is neither a local directory nor in the local Hugging Face cache "
            f"({type(e).__name__}); download it where there is network (huggingface-cli download {name_or_path}) "
            f"or give the path of a local copy"
        ) from None


def check_model_source(model_cfg: object) -> None:
    """Refuse a model option naming a checkpoint that is not here (`name_or_path`: the `hf` option)
    or a packaged model whose package is missing and not built yet (`gguf_file`: `smollm2_135m`);
    options that build their checkpoint from nothing (`tiny`) have nothing to check."""
    name_or_path = getattr(model_cfg, "name_or_path", None)
    if isinstance(name_or_path, str):
        resolve_local_checkpoint(name_or_path, "model.name_or_path")
    if isinstance(getattr(model_cfg, "gguf_file", None), str):
        from rlhf_orch.models.packaged import check_packaged_gguf_option

        check_packaged_gguf_option(model_cfg)
