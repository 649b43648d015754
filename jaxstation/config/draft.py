"""The draft model of a station that speculates with one (`MOONSHINE_SPECULATIVE=draft`): refused before anything
loads where its vocabulary differs from the model's, then planned, checked for memory, loaded and given an engine of
its own (engine/draft.py) by the station's own rules.

A draft must share the model's vocabulary: its drafts are token ids the model verifies, so the same id must mean the
same text. Both checkpoints' vocabulary sizes must match, and where both carry a tokenizer, every token's bytes.
The draft runs where the model speculates (narrow waves on the CPU kernels), and needs packed steps to catch up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from jaxstation.config.memory import check_memory
from jaxstation.config.plan import Plan, load_planned, planned_arena, planned_engine, resolve_plan
from jaxstation.config.settings import ConfigError, StationConfig
from jaxstation.engine.draft import DraftModel
from jaxstation.engine.speculative import NgramProposer, Speculation
from jaxstation.model.loader import CheckpointError, checkpoint_config, load_tokenizer, model_source


def check_draft(config: StationConfig) -> None:
    """Refuse, in one line naming both files, a draft model whose vocabulary differs from the model's (nothing to
    check without a draft model)."""
    if config.draft_model is None:
        return
    model, draft = model_source(config.model), model_source(config.draft_model)
    sizes = checkpoint_config(model).vocab_size, checkpoint_config(draft).vocab_size
    if sizes[0] != sizes[1]:
        raise ConfigError(f"{config.named('draft_model')}: the draft model {draft} has a vocabulary of {sizes[1]} "
                          f"tokens and the model {model} one of {sizes[0]}; a draft model must share the model's "
                          "vocabulary")
    spellings = _token_bytes(model), _token_bytes(draft)
    if None not in spellings and spellings[0] != spellings[1]:
        token = next(i for i, (a, b) in enumerate(zip(*spellings, strict=True)) if a != b)
        raise ConfigError(f"{config.named('draft_model')}: token {token} of the draft model {draft} is "
                          f"{spellings[1][token]!r} and of the model {model} {spellings[0][token]!r}; a draft model "
                          "must share the model's vocabulary")


def _token_bytes(source: Path) -> list[bytes] | None:
    """Every token's bytes, from the checkpoint's tokenizer; None for a checkpoint without one."""
    try:
        tokenizer = load_tokenizer(source)
    except CheckpointError:
        return None
    return [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]


def load_draft(config: StationConfig, observe: Callable[[float], None] | None = None) -> DraftModel:
    """The draft model `config` names, on an engine of the station's lanes and positions, planned as the station plans
    its model (`observe`: given each drafting round's seconds). Raises ConfigError for a draft whose vocabulary
    differs, that does not fit, or that cannot run narrow waves and packed steps here."""
    check_draft(config)
    draft_config = dataclasses.replace(config, model=config.draft_model, draft_model=None, speculative="off",
                                       prefill_budget=config.prefill_budget or "auto")  # it catches up in packed steps
    cfg = checkpoint_config(config.draft_model)
    plan = resolve_plan(draft_config, cfg)
    if len(plan.wave_widths) < 2 or not plan.prefill_budget:
        raise ConfigError(f"{config.named('draft_model')}: the draft model {config.draft_model} drafts in narrow "
                          f"waves and packed steps, which its plan here cannot run ({plan})")
    check_memory(cfg, draft_config, plan.dtype, layout=planned_arena(cfg, draft_config, plan), kv_dtype=plan.kv_dtype)
    return DraftModel(planned_engine(load_planned(draft_config, plan), draft_config, plan), observe)


def speculation(config: StationConfig, plan: Plan, draft: DraftModel | None) -> Speculation | None:
    """How the station's scheduler speculates, as its plan says: by prompt lookup, with `draft`, or not."""
    if plan.speculative == "off":
        return None
    return Speculation(draft if plan.speculative == "draft" else NgramProposer(), k=config.draft_tokens)
