"""Plots and a markdown table (docs/benchmarks.md) from the newest bench results.

Reads the newest JSON of each kind in bench/results/ (throughput, latency, roofline, peers) and draws PNGs next to
them: throughput.png (tokens/s vs K), latency.png (TTFT / inter-token / queue percentiles vs arrival rate),
roofline.png (each step as a fraction of the roofline, per lanes and live length), prefill_chunk.png (decoding lanes'
inter-token gap p50/p99 and the long prompt's TTFT vs prefill chunk size) and peers.png (best tokens/s per system).
Then prints a markdown table for docs/benchmarks.md. A kind with no result file is skipped.

Usage:
  python -m bench.report                     # plots into bench/results/, table on stdout
  python -m bench.report --results DIR --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import RESULTS

KINDS = ("throughput", "latency", "roofline", "peers")


def newest(results: Path, kind: str) -> dict | None:
    files = sorted(results.glob(f"{kind}-*.json"), key=lambda p: p.stat().st_mtime)
    if not files:
        return None
    data = json.loads(files[-1].read_text())
    data["_file"] = files[-1].name
    return data


def newest_of_each(results: Path, prefix: str) -> list[dict]:
    """The newest result of every kind whose name starts with `prefix` (throughput_lanes8, throughput_lanes32, ...)."""
    kinds = sorted({p.name.split("-", 1)[0] for p in results.glob(f"{prefix}*-*.json")})
    return [d for d in (newest(results, kind) for kind in kinds) if d is not None]


def merge_peers(runs: list[dict]) -> dict | None:
    """One peers table from several runs (e.g. one per --slots): each system's K columns side by side."""
    if not runs:
        return None
    rows: dict[str, dict] = {}
    for run in runs:
        dtype = run["config"].get("dtype", "float32")
        for r in run["rows"]:
            system = f"jaxstation {dtype}" if r["system"] == "jaxstation" else r["system"]
            row = rows.setdefault(system, {"system": system, "tokens_per_s": {}, "note": r.get("note")})
            row["tokens_per_s"].update(r.get("tokens_per_s", {}))
            if r.get("latency"):
                row["latency"] = r["latency"]
    ratios = {k: v for run in runs for k, v in (run.get("ratios") or {}).items()}
    return {"rows": list(rows.values()), "ratios": ratios, "_file": ", ".join(run["_file"] for run in runs)}


def _lanes(data: dict) -> int:
    ks = data["config"]["ks"]
    return max(ks) if data["config"].get("engine_lanes", "max") == "max" else 0


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_throughput(plt, runs: list[dict], out: Path) -> Path:
    """One curve per station (lane count) and path (scheduler, HTTP)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for data in sorted(runs, key=_lanes):
        lanes = _lanes(data)
        station = f"{lanes}-lane station" if lanes else "lanes = K"
        for name, label, style in (("direct", "scheduler", "-"), ("http", "HTTP", "--")):
            rows = data.get(name, {}).get("rows")
            if not rows:
                continue
            ks = [r["k"] for r in rows]
            med = [r["tokens_per_s"]["median"] for r in rows]
            err = [[m - r["tokens_per_s"]["min"] for m, r in zip(med, rows, strict=True)],
                   [r["tokens_per_s"]["max"] - m for m, r in zip(med, rows, strict=True)]]
            ax.errorbar(ks, med, yerr=err, marker="o", ls=style, capsize=3, label=f"{station}, {label}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests K")
    ax.set_ylabel("aggregate decode tokens/s")
    ax.set_title(f"Throughput vs concurrency ({runs[0]['config']['new_tokens']} new tokens, greedy)")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(plt, fig, out / "throughput.png")


def plot_latency(plt, data: dict, out: Path) -> Path | None:
    rows = data.get("direct") or []
    if not rows:
        return None
    rates = [r["rate"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, title, scale in ((axes[0], "ttft_s", "TTFT", 1.0), (axes[1], "itl_s", "inter-token gap", 1e3),
                                  (axes[2], "queue_s", "queue time", 1.0)):
        for p in ("p50", "p95", "p99"):
            ys = [r[key][p] * scale if r[key][p] is not None else float("nan") for r in rows]
            ax.plot(rates, ys, marker="o", label=p)
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel("ms" if scale != 1.0 else "s")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Latency under open-loop Poisson load (Scheduler, mixed prompt lengths)")
    return _save(plt, fig, out / "latency.png")


def plot_chunk(plt, data: dict, out: Path) -> Path | None:
    rows = data.get("scenario") or []
    if not rows:
        return None
    chunks = [r["chunk"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(chunks, [1e3 * r["itl_p50_s"]["median"] for r in rows], marker="o", label="decoding lanes' ITL p50")
    ax.plot(chunks, [1e3 * r["itl_p99_s"]["median"] for r in rows], marker="s", label="decoding lanes' ITL p99")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prefill chunk (tokens)")
    ax.set_ylabel("inter-token gap (ms)")
    ax2 = ax.twinx()
    ax2.plot(chunks, [r["long_ttft_s"]["median"] for r in rows], marker="^", color="tab:red",
             label="512-token prompt TTFT")
    ax2.set_ylabel("TTFT (s)")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8)
    ax.grid(alpha=0.3)
    ax.set_title("4 lanes decoding while a 512-token prompt prefills")
    return _save(plt, fig, out / "prefill_chunk.png")


def plot_roofline(plt, data: dict, out: Path) -> Path:
    rows = data["rows"]
    lives = sorted({r["live"] for r in rows})
    lanes = sorted({r["lanes"] for r in rows})
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(lives)
    for j, live in enumerate(lives):
        by = {r["lanes"]: r for r in rows if r["live"] == live}
        xs = [i + j * width for i, lane in enumerate(lanes) if lane in by]
        ax.bar(xs, [100 * by[lane]["fraction_of_roofline"] for lane in lanes if lane in by], width,
               label=f"live {live}")
    ax.set_xticks([i + width * (len(lives) - 1) / 2 for i in range(len(lanes))], [str(n) for n in lanes])
    ax.set_xlabel("lanes")
    ax.set_ylabel("% of roofline (limit / measured)")
    ax.set_title(f"Decode step vs the roofline ({data['bandwidth'] / 1e9:.0f} GB/s, "
                 f"{data['matmul_flops'] / 1e9:.0f} GFLOP/s)")
    ax.axhline(100, color="gray", lw=0.8, ls="--")
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    return _save(plt, fig, out / "roofline.png")


def plot_peers(plt, data: dict, out: Path) -> Path | None:
    rows = [r for r in data["rows"] if r.get("tokens_per_s")]
    if not rows:
        return None
    ks = sorted({int(k) for r in rows for k in r["tokens_per_s"]})
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(ks)
    for j, k in enumerate(ks):
        ax.bar([i + j * width for i in range(len(rows))],
               [r["tokens_per_s"].get(str(k), {}).get("median") or 0 for r in rows], width, label=f"K={k}")
    ax.set_xticks([i + width * (len(ks) - 1) / 2 for i in range(len(rows))], [r["system"] for r in rows])
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title(f"Same GGUF, same token ids (K = {', '.join(map(str, ks))})")
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    return _save(plt, fig, out / "peers.png")


def _f(x, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def markdown(data: dict[str, dict | None]) -> str:
    lines = []
    for t in data.get("throughput") or []:
        lines += [f"**Throughput, {_lanes(t) or 'K'}-lane station** ({t['_file']}; {t['config']['new_tokens']} new "
                  f"tokens, greedy, median of {t['config']['reps']})", "",
                  "| K | Scheduler tok/s | ratio | lanes busy | overhead | HTTP tok/s | ratio |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        direct = {r["k"]: r for r in t.get("direct", {}).get("rows", [])}
        http = {r["k"]: r for r in t.get("http", {}).get("rows", [])}
        for k in sorted(set(direct) | set(http)):
            d, h = direct.get(k, {}), http.get(k, {})
            lines.append(
                f"| {k} | {_f(d.get('tokens_per_s', {}).get('median'))} | {_f(d.get('ratio_to_first'), '{:.2f}')} "
                f"| {_f((d.get('mean_busy') or {}).get('median'), '{:.2f}')} "
                f"| {_f(100 * d['overhead_frac']['median'] if d.get('overhead_frac') else None, '{:.1f}%')} "
                f"| {_f(h.get('tokens_per_s', {}).get('median'))} | {_f(h.get('ratio_to_first'), '{:.2f}')} |")
        lines.append("")
    lat = data.get("latency")
    if lat and lat.get("direct"):
        lines += [f"**Latency under Poisson load** ({lat['_file']})", "",
                  "| rate/s | TTFT p50 / p95 / p99 s | ITL p50 / p95 / p99 ms | queue p99 s | tok/s | rejected |",
                  "|---:|---|---|---:|---:|---:|"]
        for r in lat["direct"]:
            ttft = " / ".join(_f(r["ttft_s"][p], "{:.2f}") for p in ("p50", "p95", "p99"))
            itl = " / ".join(_f(r["itl_s"][p] and 1e3 * r["itl_s"][p], "{:.0f}") for p in ("p50", "p95", "p99"))
            lines.append(f"| {r['rate']:g} | {ttft} | {itl} | {_f(r['queue_s']['p99'], '{:.2f}')} "
                         f"| {r['achieved_tokens_per_s']:.1f} | {r['rejected']} |")
        lines.append("")
    if lat and lat.get("scenario"):
        lines += ["**A 512-token prompt arriving beside 4 decoding lanes**", "",
                  "| prefill chunk | ITL p50 ms | ITL p99 ms | p99/p50 | long-prompt TTFT s |",
                  "|---:|---:|---:|---:|---:|"]
        for r in lat["scenario"]:
            lines.append(f"| {r['chunk']} | {1e3 * r['itl_p50_s']['median']:.0f} | {1e3 * r['itl_p99_s']['median']:.0f}"
                         f" | {r['p99_over_p50']['median']:.2f} | {r['long_ttft_s']['median']:.2f} |")
        lines.append("")
    rf = data.get("roofline")
    if rf:
        lines += [f"**Roofline** ({rf['_file']}; {rf['bandwidth'] / 1e9:.1f} GB/s, "
                  f"{rf['matmul_flops'] / 1e9:.0f} GFLOP/s f32)", "",
                  "| lanes | live | step ms | limit ms | of roofline |", "|---:|---:|---:|---:|---:|"]
        for r in rf["rows"]:
            lines.append(f"| {r['lanes']} | {r['live']} | {r['ms_per_step']:.1f} | {r['limit_ms']:.1f} | "
                         f"{100 * r['fraction_of_roofline']:.0f}% |")
        lines.append("")
    pe = data.get("peers")
    if pe:
        ks = sorted({int(k) for r in pe["rows"] for k in r.get("tokens_per_s", {})})
        lines += [f"**Peers** ({pe['_file']})", "", "| system | " + " | ".join(f"K={k} tok/s" for k in ks)
                  + " | latency e2e p50 / p99 s | note |", "|---|" + "---:|" * len(ks) + "---|---|"]
        for r in pe["rows"]:
            tps = r.get("tokens_per_s", {})
            e2e = (r.get("latency") or {}).get("e2e_s") or {}
            cells = " | ".join(_f(tps.get(str(k), {}).get("median")) for k in ks)
            lat_cell = f"{_f(e2e.get('p50'), '{:.2f}')} / {_f(e2e.get('p99'), '{:.2f}')}"
            lines.append(f"| {r['system']} | {cells} | {lat_cell} | {r.get('note') or ''} |")
        if pe.get("ratios"):
            lines += ["", "Ratios: " + ", ".join(f"{k} = {v:.2f}" for k, v in pe["ratios"].items())]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="where the JSON results are")
    ap.add_argument("--out", type=Path, default=None, help="where the PNGs go (default: --results)")
    args = ap.parse_args()
    out = args.out or args.results
    out.mkdir(parents=True, exist_ok=True)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = {kind: newest(args.results, kind) for kind in KINDS}
    data["throughput"] = newest_of_each(args.results, "throughput_lanes")
    data["peers"] = merge_peers(newest_of_each(args.results, "peers"))
    drawn = []
    if data["throughput"]:
        drawn.append(plot_throughput(plt, data["throughput"], out))
    if data["latency"]:
        drawn += [plot_latency(plt, data["latency"], out), plot_chunk(plt, data["latency"], out)]
    if data["roofline"]:
        drawn.append(plot_roofline(plt, data["roofline"], out))
    if data["peers"]:
        drawn.append(plot_peers(plt, data["peers"], out))
    for kind, d in data.items():
        if not d:
            print(f"<!-- no {kind}-*.json in {args.results} -->")
    print(markdown(data))
    for p in drawn:
        if p is not None:
            print(f"drew {p}")


if __name__ == "__main__":
    main()
