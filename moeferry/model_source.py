"""Where a `--model` value is found: the built-in model's name, a checkpoint directory, or a
Hugging Face model id already in the local Hugging Face cache. The cache is only read, never
downloaded into: serving starts without the network, and a model that is not there is one
line saying how to get it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from moeferry.config import ConfigError


@dataclass(frozen=True)
class ModelSource:
    """A resolved `--model`. Invariant: `path` is an existing directory (the checkpoint, or the
    cached snapshot of a model id); `name` is what the model is called when served: the
    built-in model's name, the Hugging Face id as given, or the directory's base name."""

    path: str
    name: str


def resolve_model(model: str | None, revision: str | None = None) -> ModelSource:
    """The checkpoint `model` names: None, "" or a built-in name give a built-in model (the
    random one made on first use); a directory is taken as it is; anything else is looked up as
    a model id in the local Hugging Face cache, at `revision` (None: main). ConfigError (one
    line) when it is none of these, or a revision is given for anything but a model id."""
    from moeferry import default_model

    builtin = default_model.builtin_model_dir(model)
    if builtin is None and not os.path.isdir(model):
        return ModelSource(cached_snapshot(model, revision), model)
    if revision is not None:
        raise ConfigError(f"--revision {revision}: only a Hugging Face model id has revisions, not {model or 'the built-in model'!r}")
    if builtin is not None:
        return ModelSource(builtin, model or default_model.DEFAULT_MODEL_NAME)
    name = default_model.builtin_model_name(model)
    return ModelSource(model, name or os.path.basename(os.path.realpath(model)))


def hub_cache_dir() -> str:
    """The Hugging Face hub cache, found as huggingface_hub finds it: HF_HUB_CACHE, else
    HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub. Read at
    each call, since huggingface_hub fixes its own copy when it is first imported."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return os.path.expanduser(os.path.expandvars(explicit))
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    home = os.environ.get("HF_HOME") or os.path.join(xdg, "huggingface")
    return os.path.join(os.path.expanduser(os.path.expandvars(home)), "hub")


def cached_snapshot(model_id: str, revision: str | None = None) -> str:
    """The directory of `model_id`'s snapshot at `revision` (a ref or commit; None: main) in
    the local cache, found without the network (huggingface_hub's snapshot_download with
    local_files_only)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        return snapshot_download(model_id, revision=revision, local_files_only=True, cache_dir=cache)
    except HFValidationError:  # a path, not an id: "org/name" or "name" is the only id shape
        raise ConfigError(f"model directory {model_id!r} does not exist") from None
    except LocalEntryNotFoundError:
        at = f" at revision {revision}" if revision else ""
        raise ConfigError(f"--model {model_id}: not a directory and not in the local Hugging Face cache ({cache}){at}: "
                          f"download it with `hf download {model_id}{f' --revision {revision}' if revision else ''}` "
                          f"or pass a directory") from None
