"""``kvnotes-bench peers``: load the model, build the split's cases, run every method on each,
write ``peers.json`` and ``peers.png``."""

from __future__ import annotations

import shlex
import sys
from datetime import UTC, datetime
from pathlib import Path

from kvnotes.core.machine import set_threads
from kvnotes.core.models import load, resolve
from kvnotes_bench.kit.machine import MachineRecord
from kvnotes_bench.peers.results import CaseRow, PeersResult, summarize
from kvnotes_bench.peers.runner import (
    KVBOOST_METHODS,
    POLICIES,
    CaseRunner,
    FedCounter,
    KvboostClient,
    PeersConfig,
    Say,
    measure_case,
    peak_rss_mb,
    policy_of,
)
from kvnotes_bench.peers.workloads import build_cases


def describe(method: str, best: str) -> dict[str, object]:
    """A method's settings for the JSON."""
    if method in KVBOOST_METHODS:
        return {"library": "kvboost", **KVBOOST_METHODS[method]}
    if method == "recompute":
        return {"library": "transformers", "forward": "whole prompt"}
    policy = policy_of(method, best)
    rule = POLICIES[policy]
    return {"library": "kvnotes", "policy": policy, "compile_after_header": rule.behind,
            "compiled_as_seen": rule.seen, "repair": rule.repair.tag()}


def run_peers(config: PeersConfig, out: Path, say: Say = print) -> PeersResult:
    threads = set_threads(config.threads)
    machine = MachineRecord.now()
    model_dir = resolve(config.model)
    engine = load(config.model, dtype="float32")
    tok = engine.tokenizer
    cases = [c for c in build_cases(config.split, config.cases, tok, lambda s: len(tok.encode(s)))
             if c.workload in config.workloads]
    limit = config.max_prompt_tokens or engine.adapter.max_positions or 1 << 30
    kept = [c for c in cases if len(tok.encode(c.text)) + config.greedy_tokens <= limit]
    left_out = [c.id for c in cases if c not in kept]
    out.mkdir(parents=True, exist_ok=True)
    peers = [m for m in config.methods if m in KVBOOST_METHODS]
    client = (KvboostClient(config.peers_python, Path(str(model_dir)), threads, peers,
                            out / "kvboost-worker.log") if peers else None)
    counter = FedCounter(engine.model)
    rows: list[CaseRow] = []
    try:
        for i, case in enumerate(kept):
            say(f"[{i + 1}/{len(kept)}] {case.workload}")
            rows += measure_case(CaseRunner(engine, case, config.best, counter, client),
                                 config, say)
        worker_rss = client.call({"op": "rss"})["peak_rss_mb"] if client else None
    finally:
        if client is not None:
            client.close()
    machine.finish()
    rss = {m: (worker_rss if m in KVBOOST_METHODS else peak_rss_mb()) for m in config.methods}
    result = PeersResult(
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        command=shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]), model=config.model,
        model_dir=str(model_dir), split=config.split, cases_per_workload=config.cases,
        reps=config.reps, greedy_tokens=config.greedy_tokens, best_policy=config.best,
        torch_threads=threads, machine=machine.to_dict(),
        methods={m: describe(m, config.best) for m in config.methods},
        summary=summarize(rows, {k: v for k, v in rss.items() if v is not None}), rows=rows,
        kvboost_version=client.version if client else None,
        notes=["peak RSS is per process: the main one holds recompute and kvnotes, the worker "
               "every kvboost method",
               f"cases left out as longer than {limit} tokens: {', '.join(left_out) or 'none'}"])
    return result
