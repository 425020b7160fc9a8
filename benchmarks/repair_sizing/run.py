"""Repair that sizes itself, measured on BFCL's development sets (``live_multiple``, ``multi_turn``).

``kvnotes-bench tools``'s own loop and outputs (``run_case``, ``assemble``, ``write_outputs``) on
the cases of a development set with at least ``--min-skills`` skills (a ``multi_turn`` case with
one manual places it exactly where it was compiled: every strategy equals exact there, so only
the cases with two manuals or more measure a repair). Besides the bundle ``bench tools`` writes
(``results.json``, ``report.md``, ``cases.jsonl``), it keeps ``adapt.jsonl``: per case and
strategy, what compose recomputed (``repaired``, ``planned``) and, for the adaptive rule, its
extra tokens and forwards and the relative change measured after each forward; and
``load.jsonl``, the load average sampled each minute (the machine is shared: fidelity figures
are exact counts, timings are not reported).

Example::

    python benchmarks/repair_sizing/run.py \\
        --model smollm2-135m --set multi_turn --cases 16 --min-skills 2 --max-context 8192 \\
        --strategies exact,epic:32,epic:32@0.1,epic:32~0.15 \\
        --out docs/results/tools/smollm2-135m-multi_turn-repair-sizing
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kvnotes.cli.options import ModelOptions
from kvnotes.core.machine import load_average, machine_info
from kvnotes.research.tool_runs import CaseResult, Skipped
from kvnotes_bench.tools import runner as tools_runner
from kvnotes_bench.tools.data import load_cases, spread
from kvnotes_bench.tools.prompt import case_prompt
from kvnotes_bench.tools.report import write_outputs
from kvnotes_bench.tools.runner import assemble, run_case
from kvnotes_bench.tools.strategies import SkillCache, exact_ids, parse_strategies


def _sample_load(path: Path, stop: threading.Event) -> None:
    while True:
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                "load_average": list(load_average())}) + "\n")
        if stop.wait(60):
            return


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--set", required=True, choices=("live_multiple", "multi_turn"))
    ap.add_argument("--cases", type=int, default=40)
    ap.add_argument("--min-skills", type=int, default=1)
    ap.add_argument("--ids", default="", help="only these case ids (comma-separated), in the "
                    "set's order")
    ap.add_argument("--max-context", type=int, default=None)
    ap.add_argument("--greedy", type=int, default=16)
    ap.add_argument("--strategies", required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    engine = ModelOptions(args.model, threads=1).load()
    strategies = parse_strategies(args.strategies.split(","))
    limit = args.max_context or engine.adapter.max_positions or 1 << 30
    ids = {i for i in args.ids.split(",") if i}
    cases = [c for c in spread(load_cases(args.set), args.cases)
             if len(c.skills) >= args.min_skills and (not ids or c.id in ids)]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for name in ("cases.jsonl", "adapt.jsonl", "load.jsonl"):
        (out / name).write_text("", encoding="utf-8")
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_load, args=(out / "load.jsonl", stop), daemon=True)
    sampler.start()

    # what compose recomputed per strategy, read from the notes the bench builds
    seen: dict[str, dict[str, Any]] = {}
    build = tools_runner.build

    def recording_build(engine_: Any, prompt: Any, strategy: Any, skills_: Any) -> Any:
        nb = build(engine_, prompt, strategy, skills_)
        stats = nb.meta.get("compose", {})
        seen[strategy.name] = {"repaired": stats.get("repaired", 0), **(
            {"adapt": stats["adapt"]} if "adapt" in stats else {})}
        return nb

    tools_runner.build = recording_build
    command = "python benchmarks/repair_sizing/run.py " + shlex.join(argv)
    before = machine_info()
    skills = SkillCache(engine)
    results: list[CaseResult] = []
    skipped: list[Skipped] = []
    for i, case in enumerate(cases):
        prompt = case_prompt(engine.tokenizer, case, "")
        n = len(exact_ids(engine, prompt)[0]) + len(engine.encode(prompt.query))
        if n + args.greedy > limit:
            skipped.append(Skipped(case.id, f"{n} tokens (+{args.greedy} generated) do not fit "
                                            f"the context limit of {limit}", n))
            continue
        seen.clear()
        result = run_case(engine, case, prompt, strategies, skills,
                          half="calibrate" if i % 2 == 0 else "evaluate", taus={},
                          greedy_tokens=args.greedy)
        results.append(result)
        with (out / "cases.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps(result.to_dict(), default=str) + "\n")
        with (out / "adapt.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps({"case": case.id, "tokens": n, "strategies": seen}) + "\n")
        same = {o.strategy: o.identical for o in result.outcomes}
        print(f"{time.strftime('%H:%M:%S')} {i + 1}/{len(cases)} {case.id} {n} tokens {same}",
              flush=True)
    stop.set()
    sampler.join()
    machine: dict[str, object] = dict(machine_info(since=before))
    machine["load_samples"] = [json.loads(line) for line in
                               (out / "load.jsonl").read_text(encoding="utf-8").splitlines()
                               if line.strip()]
    result = assemble(results, strategies, model=args.model, set_name=args.set, taus={},
                      skipped=skipped, machine=machine,
                      settings={"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                "command": command, "device": "cpu", "dtype": "float32",
                                "cases_asked": args.cases, "min_skills": args.min_skills,
                                "greedy_tokens": args.greedy, "context_limit": limit,
                                "variants_compiled": skills.compiled})
    paths = write_outputs(result, out, command)
    print(f"wrote {paths}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
