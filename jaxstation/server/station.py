"""The station: the model, its engine, the scheduler, the metrics and the readiness state, and nothing of HTTP.

Weights load and every compiled step warms up in a background thread started with the app, so `/health` answers at
once and `/ready` turns 200 only when the station can serve. `shutdown` drains: new requests are refused while
in-flight ones finish (up to `drain_s`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

import jax

from jaxstation.config.coldstart import CompileCount, StartupClock, enable_compile_cache, is_local
from jaxstation.config.draft import load_draft, speculation
from jaxstation.config.memory import arena_summary, check_memory, prefix_cache_disk, prefix_cache_ram
from jaxstation.config.plan import Plan, load_planned, planned_arena, planned_engine, startup_plan
from jaxstation.config.settings import StationConfig
from jaxstation.engine import host_memory
from jaxstation.engine.constraints import Constraint, ConstraintError, ConstraintSpec, Grammars
from jaxstation.engine.draft import DraftModel
from jaxstation.engine.jobs import Job
from jaxstation.engine.metrics import StationMetrics
from jaxstation.engine.runner import Runner
from jaxstation.engine.scheduler import Scheduler
from jaxstation.engine.warmup import StepTimes
from jaxstation.model.loader import CheckpointError, LoadedModel
from jaxstation.model.lora_files import AdapterError
from jaxstation.server.adapters import Adapters

log = logging.getLogger(__name__)

EngineFactory = Callable[[LoadedModel, StationConfig, Plan], Runner]  # builds a station's engine once it has loaded


class Station:
    """One serving station: config, plan, model, engine, scheduler, metrics, and whether it is ready.

    model: an already loaded model (tests, or a caller that loaded it); None loads `config.model` in `start`.
    engine_factory: builds the engine from the loaded model, the config and the plan (default: a local `Engine`; a
    mesh host passes its own).
    before_warmup: called in the loading thread right before the warm-up compiles (a test hook to observe /ready 503).
    clock: where start-up phase times go (logged, and gauges on /metrics); default: one counting from here.
    """

    def __init__(self, config: StationConfig, *, model: LoadedModel | None = None,
                 before_warmup: Callable[[], None] | None = None, clock: StartupClock | None = None,
                 engine_factory: EngineFactory | None = None) -> None:
        self.config = config
        self.plan: Plan | None = None  # resolved once by the loading thread, before the weights load
        self.model = model
        self.metrics = StationMetrics()
        self.clock = clock or StartupClock()  # serve() passes one that counts from process start
        self.clock.add_sink(lambda phase, seconds: self.metrics.startup.labels(phase).set(seconds))
        self.engine: Runner | None = None
        self._engine_factory = engine_factory or local_engine
        self.scheduler: Scheduler | None = None
        self.grammars: Grammars | None = None  # compiles structured-output constraints, once the model is loaded
        self.adapters: Adapters | None = None  # the LoRA adapters by name, where the plan holds any (--max-loras)
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.on_load_failed: Callable[[], None] | None = None
        self._before_warmup = before_warmup
        self._draining = False
        self._stopped = False
        self._lock = threading.Lock()
        self._loader: threading.Thread | None = None

    # ---- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Load, build and warm up in a background thread; returns at once. A station started already is left as it
        is (an in-process station served over HTTP too: the app's lifespan starts it again)."""
        if self._loader is not None:
            return
        self._loader = threading.Thread(target=self._load, name="jaxstation-load", daemon=True)
        self._loader.start()

    def _load(self) -> None:
        """Plan, load, allocate, compile every step shape, start the decode thread; each phase timed on `self.clock`."""
        clock, c = self.clock, self.config
        try:
            enable_compile_cache(c.compile_cache_dir)
            programs = CompileCount()
            with host_memory.paging_deferred():  # the weights' pages move once the warm-up is done
                draft = self._build()
                if self._before_warmup is not None:
                    self._before_warmup()
                warm_up(self.engine, draft, clock)
            compiled, cached = programs.delta()
            self.metrics.startup_programs.labels("compiled").set(compiled)
            self.metrics.startup_programs.labels("cache").set(cached)
            log.info("start-up programs: %d compiled, %d read from the persistent compilation cache", compiled, cached)
            tok = self.model.tokenizer
            ram = prefix_cache_ram(c)
            scheduler = Scheduler(self.engine, continuous=c.continuous, max_queue=c.max_queue,
                                  terminal_ids=tok.terminal_ids if tok is not None else frozenset(),
                                  metrics=self.metrics, speculation=speculation(c, self.plan, draft),
                                  prefix_cache_ram=ram,
                                  prefix_cache_disk=prefix_cache_disk(c, self.engine))
            with self._lock:
                if self._stopped:  # shut down while loading
                    scheduler.prefix_tier.close()
                    return
                scheduler.start()
                self.scheduler = scheduler
            if tok is not None:
                self.grammars = Grammars(tok, self.model.cfg.vocab_size, self.eos_ids)
            clock.record("ready", clock.since_start())
            self.ready.set()
            log.info("ready: %d lanes x %d positions, continuous=%s", c.lanes, c.max_seq, c.continuous)
        except Exception as e:
            start_failed(self, e)

    def _build(self) -> DraftModel | None:
        """Load the model (unless given), plan, allocate the engine, load the LoRA adapters; returns the draft model
        where the plan speculates with one."""
        clock, c = self.clock, self.config
        if self.model is None:
            with clock.phase("weight_load"):  # the plan's kernel probe builds the CPU kernel on first use
                self.plan = startup_plan(c)
                self.model = load_planned(c, self.plan)
            log.info("loaded %s", self.model.source)
        else:
            self.plan = startup_plan(c, self.model.cfg)
        if c.chat_template is not None:
            self.model = dataclasses.replace(self.model, tokenizer=self.model.tokenizer.with_chat_template(
                c.chat_template))
        with clock.phase("arena_alloc"):
            self.engine = self._engine_factory(self.model, c, self.plan)
        if self.plan.max_loras:
            with clock.phase("lora_load"):
                self.adapters = Adapters(self.engine, self._lora_in_use)
                for name, path in c.lora_modules:
                    try:
                        log.info("LoRA adapter %s: slot %d", name, self.adapters.load(name, path).slot)
                    except AdapterError as e:
                        raise AdapterError(f"{c.named('lora_modules')} {name}={path}: {e}") from None
        draft = None
        if self.plan.speculative == "draft":
            with clock.phase("draft_load"):
                draft = load_draft(c, self.metrics.step.labels("draft").observe)
        return draft

    def _lora_in_use(self) -> set[int]:
        return self.scheduler.lora_slots() if self.scheduler is not None else set()

    def use_adapter(self, job: Job, name: str | None) -> bool:
        """Point `job` at the LoRA adapter called `name`, if one is loaded; False (the job runs on the base model)
        otherwise."""
        resident = self.adapters.get(name) if self.adapters is not None else None
        if resident is not None:
            job.lora, job.lora_load = resident.slot, resident.load
        return resident is not None

    def compile_constraint(self, spec: ConstraintSpec) -> Constraint:
        """A request's constraint, compiled (blocking: call it off the event loop). Raises ConstraintError."""
        if self.grammars is None:
            raise ConstraintError(spec.field, f"{spec.field}: structured outputs need the model's tokenizer, and this "
                                              "checkpoint has none")
        return self.grammars.compile(spec)

    @property
    def loading(self) -> bool:
        """Whether the loading thread is still loading weights or compiling."""
        return self._loader is not None and self._loader.is_alive()

    @property
    def draining(self) -> bool:
        return self._draining

    def begin_drain(self) -> None:
        """Stop admitting: from now on /generate answers 503 and /ready 503."""
        self._draining = True

    def shutdown(self, timeout_s: float | None = None) -> bool:
        """Stop admitting, let in-flight jobs finish for up to timeout_s (default drain_s), stop the decode thread.

        Idempotent. Returns True if nothing had to be failed.
        """
        self.begin_drain()
        with self._lock:
            self._stopped = True
            scheduler = self.scheduler
        if scheduler is None:
            return True
        return scheduler.drain(self.config.drain_s if timeout_s is None else timeout_s)

    @property
    def eos_ids(self) -> frozenset[int]:
        tok = self.model.tokenizer if self.model is not None else None
        return frozenset(tok.eos_ids) if tok is not None else frozenset()


def local_engine(model: LoadedModel, c: StationConfig, plan: Plan) -> Runner:
    """The station's own engine, once its arena is known to fit, with the arena allocated. The process keeps freed
    memory from here on (`host_memory.keep_freed_memory`), so that a step's buffers are not paged in every call."""
    host_memory.keep_freed_memory()
    check_memory(model.cfg, c, plan.dtype, weights_resident=True, layout=planned_arena(model.cfg, c, plan),
                 kv_dtype=plan.kv_dtype)
    engine = planned_engine(model, c, plan)
    if c.compile_cache_dir and is_local(c.compile_cache_dir):  # the step times go beside the compilation cache
        engine.step_times = StepTimes(c.compile_cache_dir.removeprefix("file://"), engine)
        engine.step_s.update(engine.step_times.load())
    jax.block_until_ready(engine.arena)
    log.info("KV arena: %s", arena_summary(engine.arena, engine.windowed))
    return engine


def warm_up(engine: Runner, draft: DraftModel | None = None, clock: StartupClock | None = None) -> None:
    """Compile and run every step of `engine` (then of `draft`), each timed as a phase `warmup_<step>` on `clock`,
    with the weights' move onto 2 MiB pages held back until it ends. The one warm-up of a station and of a group's
    followers, so every process of a group compiles the same programs in the same order."""
    cpu, released = jax.default_backend() == "cpu", 0
    with host_memory.paging_deferred():
        for name, run in [*engine.warmup_steps(), *(draft.warmup_steps() if draft else [])]:
            with clock.phase(f"warmup_{name}") if clock else contextlib.nullcontext():
                run()
                jax.block_until_ready(engine.arena)
            if cpu:  # each compiler's working memory, which keep_freed_memory would keep, so it never piles up
                released += host_memory.release_freed_memory()
        if cpu:  # and the steps' buffers, kept in XLA's execution threads' arenas
            released += host_memory.release_freed_memory(execution_threads=True)
            log.info("start-up memory handed back: %.0f MiB", released / 2**20)


def start_failed(station: Any, error: Exception) -> None:
    """A Station's or MeshStation's loading thread failed: log it, keep the message for /health and /ready, and
    tell the server. A checkpoint that cannot be loaded is said in the server's one exit line, without a traceback."""
    if not isinstance(error, CheckpointError):
        log.exception("station failed to start")
    station.load_error = f"{type(error).__name__}: {error}"
    if station.on_load_failed is not None:
        station.on_load_failed()
