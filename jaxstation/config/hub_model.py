"""A station's model named as on the Hugging Face Hub, made local once, before anything reads it: the settings' model
(and draft model) become the downloaded (or cached) checkpoint's path, and the name the user typed becomes the served
model's name unless `--served-model-name` gives one. Plain Python, no JAX."""

from __future__ import annotations

import dataclasses

from jaxstation.config.setting_values import ConfigError
from jaxstation.config.settings import StationConfig
from jaxstation.model.hub import fetch, is_hub_name


def local_path(model: str | None, revision: str | None = None, revision_name: str = "--revision") -> str | None:
    """`model` as a local checkpoint's path: a Hub name fetched at `revision`, anything else as it is. A revision
    for a model that is not a Hub name is refused, named `revision_name`."""
    if is_hub_name(model):
        return str(fetch(model, revision))
    if revision is not None:
        raise ConfigError(f"{revision_name}={revision!r} pins a Hub model's revision, and the model "
                          f"{model or '(the embedded default)'} is not one (org/name)")
    return model


def local_model(config: StationConfig) -> StationConfig:
    """`config` with its model and draft model as local checkpoints' paths (downloaded where the cache lacks them),
    serving a Hub model under the name it was given."""
    if not (is_hub_name(config.model) or is_hub_name(config.draft_model) or config.revision is not None):
        return config
    names = config.served_model_name or ((config.model,) if is_hub_name(config.model) else ())
    return dataclasses.replace(config, model=local_path(config.model, config.revision, config.named("revision")),
                               draft_model=local_path(config.draft_model), revision=None, served_model_name=names)
