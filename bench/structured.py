"""What structured outputs cost: throughput with every request held to a JSON schema against the same requests
unconstrained, the host time per wave spent on masks, and the compile time of real schemas.

Throughput: K requests at once (K = 1, 8, 32) through the Scheduler on an Engine of K lanes, greedy, 48 new tokens,
no stop ids; constrained requests follow a schema that does not end before max_tokens (an array of records), so
both runs generate the same number of tokens. Aggregate tokens/s = tokens / wall, median of --reps, the two modes
alternating per rep. Mask time: the scheduler's `_mask` (the grammar's mask, min_tokens and allowed_token_ids folded
in), timed per call and summed per decode wave. Compile: `Grammars.compile` (grammar built, matcher made, first mask
computed) for each schema in SCHEMAS: pydantic models as the OpenAI SDK's `parse()` sends them, and tool-parameter
schemas; p50 and p99 of --compile-reps runs each.

Writes bench/results/structured-<model>.json.
Usage:
  python -m bench.structured [--ks 1 8 32] [--reps 3] [--new-tokens 48]
"""

from __future__ import annotations

import argparse
import datetime as dt
import enum
import statistics
import time

import numpy as np
import pydantic

from bench.common import add_model_args, bench_model, model_name, write_result
from bench.workload import make_prompts

ITEM = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "id": {"type": "integer"},
                                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                  "maxItems": 3}},
        "required": ["name", "id", "tags"], "additionalProperties": False}
RECORDS = {"type": "array", "items": ITEM, "minItems": 20}  # cannot complete within the run's max_tokens


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Address(pydantic.BaseModel):
    street: str
    city: str
    postcode: str = pydantic.Field(pattern=r"^[0-9]{5}$")
    country: str = "FR"


class Person(pydantic.BaseModel):
    name: str
    age: int = pydantic.Field(ge=0, le=150)
    email: str | None = None
    address: Address


class LineItem(pydantic.BaseModel):
    sku: str
    quantity: int = pydantic.Field(ge=1)
    unit_price: float


class Order(pydantic.BaseModel):
    order_id: str
    items: list[LineItem] = pydantic.Field(min_length=1)
    total: float
    paid: bool


class Event(pydantic.BaseModel):
    title: str
    start: dt.datetime
    end: dt.datetime
    attendees: list[str]
    location: str | None = None


class Sentiment(pydantic.BaseModel):
    label: str = pydantic.Field(pattern="^(positive|negative|neutral)$")
    confidence: float = pydantic.Field(ge=0, le=1)


class Extraction(pydantic.BaseModel):
    entities: list[str]
    relations: list[tuple[str, str, str]]
    summary: str = pydantic.Field(max_length=280)


class Paint(pydantic.BaseModel):
    color: Color
    gloss: bool
    litres: float


class Step(pydantic.BaseModel):
    explanation: str
    output: str


class MathReasoning(pydantic.BaseModel):  # the OpenAI structured-outputs guide's example
    steps: list[Step]
    final_answer: str


class Node(pydantic.BaseModel):  # recursive: a tree
    value: str
    children: list[Node] = []


class Invoice(pydantic.BaseModel):
    vendor: str
    date: dt.date
    lines: list[LineItem]
    billing: Address
    shipping: Address | None = None
    notes: list[str] = []


class Classification(pydantic.BaseModel):
    category: str = pydantic.Field(pattern="^(bug|feature|question|docs)$")
    priority: int = pydantic.Field(ge=1, le=5)
    duplicate_of: int | None = None


MODELS = [Address, Person, LineItem, Order, Event, Sentiment, Extraction, Paint, MathReasoning, Node, Invoice,
          Classification]


def tool(name: str, properties: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


STRING, INT, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
TOOLS = {
    "get_weather": tool("get_weather", {"city": STRING, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                        ["city"]),
    "web_search": tool("web_search", {"query": STRING, "max_results": {"type": "integer", "minimum": 1,
                                                                       "maximum": 20}}, ["query"]),
    "send_email": tool("send_email", {"to": {"type": "array", "items": {"type": "string", "format": "email"}},
                                      "subject": STRING, "body": STRING, "cc": {"type": "array", "items": STRING}},
                       ["to", "subject", "body"]),
    "create_event": tool("create_event", {"title": STRING, "start": {"type": "string", "format": "date-time"},
                                          "duration_minutes": INT, "invitees": {"type": "array", "items": STRING}},
                         ["title", "start"]),
    "run_sql": tool("run_sql", {"query": STRING, "database": {"type": "string", "enum": ["prod", "staging"]},
                                "read_only": BOOL}, ["query"]),
    "get_stock_price": tool("get_stock_price", {"ticker": {"type": "string", "pattern": "^[A-Z]{1,5}$"}},
                            ["ticker"]),
    "translate": tool("translate", {"text": STRING, "source": STRING, "target": STRING}, ["text", "target"]),
    "book_flight": tool("book_flight", {"origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                        "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                        "date": {"type": "string", "format": "date"},
                                        "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                                        "cabin": {"type": "string", "enum": ["economy", "business", "first"]}},
                        ["origin", "destination", "date"]),
    "set_thermostat": tool("set_thermostat", {"room": STRING, "temperature": {"type": "number", "minimum": 5,
                                                                              "maximum": 30}}, ["room",
                                                                                                "temperature"]),
    "file_ticket": tool("file_ticket", {"title": STRING, "severity": {"type": "string", "enum": ["low", "high"]},
                                        "labels": {"type": "array", "items": STRING, "maxItems": 5}},
                        ["title"]),
}


def schemas() -> dict[str, dict]:
    """Every schema of the compile measurement, by name."""
    out = {f"model:{m.__name__}": m.model_json_schema() for m in MODELS}
    out.update({f"tool:{name}": s for name, s in TOOLS.items()})
    out["records"] = RECORDS
    out["json_object"] = {"type": "object"}
    return out


def compile_times(grammars, reps: int) -> dict:
    from jaxstation.engine.constraints import ConstraintSpec

    per: dict[str, list[float]] = {}
    for name, schema in schemas().items():
        spec = ConstraintSpec("json", schema, "response_format")
        per[name] = []
        for _ in range(reps):
            t0 = time.perf_counter()
            grammars.compile(spec)
            per[name].append(time.perf_counter() - t0)
    firsts = [times[0] for times in per.values()]
    alls = sorted(t for times in per.values() for t in times)
    return {"schemas": len(per), "reps": reps,
            "p50_ms": 1e3 * statistics.median(alls), "p99_ms": 1e3 * float(np.percentile(alls, 99)),
            "max_ms": 1e3 * alls[-1], "first_compile_p50_ms": 1e3 * statistics.median(firsts),
            "per_schema_median_ms": {n: 1e3 * statistics.median(t) for n, t in per.items()}}


class MaskTimer:
    """Wraps a scheduler's `_mask`: host seconds per call on a constrained lane, summed per decode wave."""

    def __init__(self, scheduler) -> None:
        self.calls: list[float] = []
        self._scheduler, self._mask = scheduler, scheduler._mask
        scheduler._mask = self

    def __call__(self, i: int):
        constrained = self._scheduler.lanes[i].job.constraint is not None
        t0 = time.perf_counter()
        try:
            return self._mask(i)
        finally:
            if constrained:
                self.calls.append(time.perf_counter() - t0)


def throughput(model, grammars, k: int, args) -> dict:
    from jaxstation.engine.constraints import ConstraintSpec
    from jaxstation.engine.engine import Engine
    from jaxstation.engine.jobs import Job
    from jaxstation.engine.scheduler import Scheduler

    engine = Engine(model, lanes=k, max_seq=256, chunk=32, block=128, **args.engine_kw)
    engine.warmup()
    prompts = make_prompts(model.tokenizer, k, 24, seed=k)
    spec = ConstraintSpec("json", RECORDS, "response_format")
    runs: dict[str, list[float]] = {"plain": [], "constrained": []}
    mask_per_wave, waves_seen = [], []
    for rep in range(args.reps + 1):  # the first round warms up
        for mode in ("plain", "constrained"):
            sched = Scheduler(engine, continuous=True, max_queue=4 * k, terminal_ids=frozenset())
            timer = MaskTimer(sched)
            sched.start()
            jobs = [Job(tokens=p, max_new_tokens=args.new_tokens, reuse_prefix=False,
                        constraint=grammars.compile(spec) if mode == "constrained" else None) for p in prompts]
            t0 = time.perf_counter()
            futures = [sched.submit(j) for j in jobs]
            results = [f.result(600) for f in futures]
            wall = time.perf_counter() - t0
            waves = sched.waves
            sched.drain(10)
            tokens = sum(len(r.generated) for r in results)
            assert tokens == k * args.new_tokens, (mode, tokens)
            if rep:
                runs[mode].append(tokens / wall)
                if mode == "constrained":
                    mask_per_wave.append(sum(timer.calls) / max(1, waves))
                    waves_seen.append(waves)
    plain, constrained = statistics.median(runs["plain"]), statistics.median(runs["constrained"])
    return {"k": k, "plain_tok_s": plain, "constrained_tok_s": constrained, "ratio": constrained / plain,
            "runs": runs, "mask_ms_per_wave": 1e3 * statistics.median(mask_per_wave),
            "mask_ms_per_row": 1e3 * statistics.median(mask_per_wave) / k, "waves": waves_seen}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--compile-reps", type=int, default=5)
    args = ap.parse_args()
    from jaxstation.engine.constraints import Grammars

    model, args.engine_kw = bench_model(args, 256)
    tok = model.tokenizer
    grammars = Grammars(tok, model.cfg.vocab_size, tok.eos_ids)
    t0 = time.perf_counter()
    grammars.tokenizer()
    result = {"model": str(model.source), "dtype": args.dtype, "new_tokens": args.new_tokens,
              "llguidance_tokenizer_s": time.perf_counter() - t0,
              "compile": compile_times(grammars, args.compile_reps), "throughput": []}
    c = result["compile"]
    print(f"compile over {c['schemas']} schemas: p50 {c['p50_ms']:.2f} ms, p99 {c['p99_ms']:.2f} ms")
    for k in args.ks:
        row = throughput(model, grammars, k, args)
        result["throughput"].append(row)
        print(f"K={k}: {row['plain_tok_s']:.1f} vs {row['constrained_tok_s']:.1f} tok/s constrained "
              f"({row['ratio']:.3f}x), masks {row['mask_ms_per_wave']:.2f} ms/wave")
    path = write_result("structured", result, model=model_name(args.model, args.shape))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
