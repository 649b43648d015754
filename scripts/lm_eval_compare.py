"""Compare two lm-eval runs' per-sample outputs (`--log_samples`): the station's and transformers' (`--model hf`).

Usage: python scripts/lm_eval_compare.py STATION_OUTPUT_DIR HF_OUTPUT_DIR
Each directory is an `--output_path`; the newest samples_<task>_*.jsonl of every task found in both is compared:
loglikelihood tasks by the largest difference of a (context, continuation) log-probability and how many is_greedy
flags differ, generation tasks by how many generated strings differ. Standard library only.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def newest_samples(root: Path) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in sorted(root.rglob("samples_*.jsonl")):
        task = re.sub(r"_\d{4}-\d\d-\d\dT.*$", "", path.stem.removeprefix("samples_"))
        found[task] = path  # sorted by timestamp: the last one wins
    return found


def load(path: Path) -> dict[int, dict]:
    return {s["doc_id"]: s for s in map(json.loads, path.read_text().splitlines())}


def compare(task: str, ours: dict[int, dict], theirs: dict[int, dict]) -> str:
    if ours.keys() != theirs.keys():
        return f"{task}: different documents ({len(ours)} vs {len(theirs)})"
    pairs = [(ra[0], rb[0]) for doc_id, a in ours.items()
             for ra, rb in zip(a["resps"], theirs[doc_id]["resps"], strict=True)]
    if all(isinstance(x, list) for x, _ in pairs):  # loglikelihood: [logprob, is_greedy]
        worst = max(abs(float(x[0]) - float(y[0])) for x, y in pairs)
        greedy = sum(x[1] != y[1] for x, y in pairs)
        return f"{task}: {len(pairs)} loglikelihoods, max |difference| {worst:.2e}, is_greedy differs in {greedy}"
    differ = sum(x != y for x, y in pairs)  # generation: the generated text
    return f"{task}: {len(pairs)} generations, {differ} differ"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    ours, theirs = newest_samples(Path(argv[0])), newest_samples(Path(argv[1]))
    tasks = sorted(ours.keys() & theirs.keys())
    if not tasks:
        print("no task has samples in both directories", file=sys.stderr)
        return 1
    for task in tasks:
        print(compare(task, load(ours[task]), load(theirs[task])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
