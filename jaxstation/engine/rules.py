"""What an engine can run, as rules in one place: which decode attention serves a model, which decode wave widths and
which packed admission budget its weights allow, the defaults of both, and whether its arena feeds the prefix cache's
host tier.

`Engine` applies them to what its caller passes; the station's plan (config/plan.py) applies the same rules to the
settings at start-up, so that a refusal names the flag or environment variable that asked for it. Each refusal is a
reason (a string) or None, and its caller words the error.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxstation.engine.choices import PACK_BUDGET_AUTO
from jaxstation.engine.runner import Runner
from jaxstation.kernels import cpu_kernel
from jaxstation.model.config import ModelConfig

ROW_ATTENTIONS = ("blocked", "kernel")  # those that take any subset of lanes, so waves may run narrow
KERNEL_KV_DTYPES = (jnp.float32, jnp.bfloat16, jnp.int8)  # the arenas the attention kernel reads in place


def attention_refusal(cfg: ModelConfig, attention: str, dtype: jnp.dtype, max_seq: int,
                      kv_dtype: jnp.dtype | None = None) -> str | None:
    """Why `attention` cannot serve `cfg`'s model with `dtype` activations over `max_seq` positions of a `kv_dtype`
    arena (default: the activations' dtype), or None."""
    if attention == "kernel" and not cpu_kernel.attention_serves(cfg.head_dim, cfg.group_size, dtype):
        return ("needs float32 activations, head_dim a multiple of 16 (up to 256), at most 8 query heads per kv head, "
                "and the CPU kernel built here")
    if attention == "kernel" and kv_dtype is not None and kv_dtype not in KERNEL_KV_DTYPES:
        return f"reads a float32, bfloat16 or int8 arena, not {jnp.dtype(kv_dtype).name}: it needs attention='blocked'"
    if attention != "blocked" and cfg.attn_softcap is not None:
        return f"does not soft-cap scores; this model caps them at {cfg.attn_softcap}: it needs attention='blocked'"
    window = cfg.sliding_window
    if attention in ("xla", "cudnn") and window is not None and max_seq > window:
        return f"does not window; with a sliding window of {window} it needs max_seq <= the window, got {max_seq}"
    return None


def narrow_waves(row_invariant: bool, attention: str) -> bool:
    """Whether waves may run narrower than the arena, and prompts pack: every matmul on the CPU kernel, whose rows do
    not depend on how many rows a call has, and an attention that takes any subset of lanes."""
    return row_invariant and attention in ROW_ATTENTIONS


def default_wave_widths(lanes: int, narrow: bool) -> tuple[int, ...]:
    """The decode widths an engine runs unless told: where waves may run narrow, 1, 2, 4, ... below `lanes`, then
    `lanes` (a lone request runs a 1-row step; each width is one more compiled program); else only `lanes`."""
    if not narrow:
        return (lanes,)
    widths, w = [], 1
    while w < lanes:
        widths.append(w)
        w *= 2
    return (*widths, lanes)


def default_prefill_budget(lanes: int, narrow: bool) -> int:
    """The packed admission budget unless told: PACK_BUDGET_AUTO rows, or the lanes if more, where waves may run
    narrow; else 0 (prompts enter one prefill chunk at a time)."""
    return max(PACK_BUDGET_AUTO, lanes) if narrow else 0


def widths_refusal(widths: tuple[int, ...], lanes: int, row_invariant: bool, attention: str) -> str | None:
    """Why an engine of `lanes` lanes cannot run decode waves at `widths` (sorted), or None."""
    if widths[-1] != lanes or widths[0] < 1:
        return f"decode widths must lie in [1, lanes] and include lanes ({lanes}), got {widths}"
    if len(widths) > 1 and not narrow_waves(row_invariant, attention):
        return ("decode waves narrower than the arena need every matmul on the CPU kernel and the blocked or kernel "
                f"attention (matmul kernel: {row_invariant}, attention {attention})")
    return None


def budget_refusal(budget: int, lanes: int, row_invariant: bool, attention: str) -> str | None:
    """Why an engine of `lanes` lanes cannot pack `budget` rows a step (0: it does not pack), or None."""
    if budget and not (narrow_waves(row_invariant, attention) and budget >= lanes):
        return (f"packed admission needs every matmul on the CPU kernel, the blocked or kernel attention and a budget "
                f"of at least the lanes ({lanes}), got {budget} rows (matmul kernel: {row_invariant}, attention "
                f"{attention})")
    return None


PACK_FLOOR = 16  # the narrowest packed step
SLOT_FLOOR = 8  # the fewest sampled rows of a packed step, where it may sample more than twice as many


def pack_widths(budget: int) -> tuple[int, ...]:
    """The row counts of packed steps under a budget of `budget` rows: halvings of the budget down to the first at or
    below PACK_FLOOR, so that a turn of short prompts, or one kept to its decode rows' pace (`Engine.turn_rows`), runs a
    narrow step (each width one more compiled program)."""
    widths = [budget]
    while widths[-1] > PACK_FLOOR and widths[-1] % 2 == 0:
        widths.append(widths[-1] // 2)
    return tuple(sorted(widths))


def pack_slots(width: int, lanes: int) -> tuple[int, ...]:
    """The sampled-row counts of a packed step of `width` rows: one row per lane at most (`min(width, lanes)`), and
    SLOT_FLOOR too where that is more than twice as many, so that a turn that ends few prompts and decodes few lanes
    runs the head and the sampling over few rows (each count one more compiled program)."""
    full = min(width, lanes)
    return (SLOT_FLOOR, full) if full > 2 * SLOT_FLOOR else (full,)


def tier_refusal(engine: Runner) -> str | None:
    """Why `engine`'s arena cannot feed the prefix cache's host tier (engine/prefix_tier.py), or None."""
    if engine.arena is None:
        return "the KV lives on mesh stations"
    if len(engine.arena.k.devices()) > 1:
        return "the arena is split over devices (--tensor-parallel), and the copies are checked on one device only"
    return None
