"""The peers benchmark's loop: every case, every method, against a full recompute.

Methods (see docs/bench/peers.md):

- ``recompute``: the reference, one plain transformers forward over the whole prompt, then
  greedy decoding on its cache;
- ``kvnotes``: each chunk compiled once (``engine.compile`` with its defaults), the prompt
  ``engine.compose([header, *chunks, tail])`` with its defaults;
- ``kvnotes-best``: the repair policy ``--best`` names (:data:`POLICIES`), chosen on the
  ``dev`` split; ``kvnotes:<policy>`` runs any of them;
- ``kvboost-*``: kvboost 0.9.0 in its own process (:mod:`.kvboost_worker`), every request on a
  cache cleared and warmed with ``warm()`` on each chunk and on the context as an earlier
  request held it (``PeerCase.seen``), then ``generate``.

Per case, the first round decodes ``greedy_tokens`` greedy tokens (identity, accuracy) and is
the warm-up; ``reps`` timed rounds follow, the methods' order rotating each round.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvnotes.core.engine import Engine
from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.notebook import Notebook
from kvnotes.core.repair import DEFAULT_REPAIR, Repair
from kvnotes_bench.peers.results import CaseRow, answer_ok
from kvnotes_bench.peers.workloads import PeerCase

REC = {"chunk_boundary_window": 16, "overlap_k": 16, "sink_tokens": 32, "recency_window_chunks": 8}
KVBOOST_METHODS: dict[str, dict[str, Any]] = {  # InferenceEngine keywords (its defaults otherwise)
    "kvboost-selective": {"recompute_strategy": "selective"},
    "kvboost-cacheblend": {"recompute_strategy": "cacheblend"},
    # the continuity settings kvboost's README gives for its published runs
    "kvboost-selective-rec": {"recompute_strategy": "selective", **REC},
    "kvboost-cacheblend-rec": {"recompute_strategy": "cacheblend", **REC},
}


@dataclass(frozen=True, slots=True)
class Policy:
    """How kvnotes warms a case's chunks and repairs them: ``behind``: each chunk compiled
    behind the header; ``seen``: the chunks compiled as the warm-up prompt showed them
    (``engine.compile_skills`` over the header and the chunks in their seen order, each behind
    everything before it: what kvboost's prefix warm-up gets too); ``repair``: compose's."""

    behind: bool
    repair: Repair
    seen: bool = False


KVDEV = Repair(first=32, share=0.1, budget=0.1, select="kv_deviation")
POLICIES: dict[str, Policy] = {
    "default": Policy(False, DEFAULT_REPAIR),
    "anchor": Policy(True, DEFAULT_REPAIR),
    "share0.25": Policy(False, Repair(first=32, share=0.25)),
    "anchor-share0.25": Policy(True, Repair(first=32, share=0.25)),
    "anchor-kvdev0.1": Policy(True, KVDEV),
    # CacheBlend's rule alone: the 15% of spliced tokens whose notes deviate most
    "cacheblend0.15": Policy(False, Repair(first=0, budget=0.15, select="kv_deviation")),
    "seen": Policy(True, DEFAULT_REPAIR, seen=True),
    "seen-kvdev0.1": Policy(True, KVDEV, seen=True),
}
DEFAULT_METHODS = ("recompute", "kvnotes", "kvnotes-best", *KVBOOST_METHODS)


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request of one method: its greedy tokens, seconds to the first token, tokens served
    from cache and tokens fed through the model before the first token."""

    tokens: list[int]
    ttft_s: float
    reused: int
    fed: int


class FedCounter:
    """Counts the tokens fed through a transformers model while :attr:`on` is set."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.on, self.fed = False, 0
        model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, _m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x = kwargs.get("input_ids", args[0] if args else None)
        if x is None:
            x = kwargs.get("inputs_embeds")
            n = 0 if x is None else int(x.shape[-2])
        else:
            n = int(x.shape[-1])
        if self.on:
            self.fed += n

    def start(self) -> None:
        self.on, self.fed = True, 0


class KvboostClient:
    """The kvboost worker process (``python -m kvnotes_bench.peers.kvboost_worker``)."""

    def __init__(self, python: str, model_dir: Path, threads: int, methods: Sequence[str],
                 log: Path) -> None:
        if not Path(python).exists():
            raise InvalidArgumentError(f"{python} not found: kvboost runs in its own environment; "
                                       "`make peers` makes it")
        self.log = log.open("w")
        self.proc = subprocess.Popen([python, "-m", "kvnotes_bench.peers.kvboost_worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True)
        self.version = str(self.call({"op": "load", "model_dir": str(model_dir),
                                      "threads": threads,
                                      "methods": {m: KVBOOST_METHODS[m] for m in methods}})
                           ["kvboost_version"])

    def call(self, req: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise InvalidArgumentError(f"the kvboost worker exited; see {self.log.name}")
        reply: dict[str, Any] = json.loads(line)
        if not reply.pop("ok"):
            raise InvalidArgumentError(f"kvboost worker: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.log.close()


def recompute(engine: Engine, ids: list[int], n: int, counter: FedCounter) -> Outcome:
    """A plain transformers forward over ``ids``, then ``n`` greedy tokens on its cache."""
    model: Any = engine.model
    counter.start()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        ttft, fed = time.perf_counter() - t0, counter.fed
        counter.on = False
        past = out.past_key_values
        while len(tokens) < n and tokens[-1] not in engine.eos_ids:
            out = model(input_ids=torch.tensor([tokens[-1:]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            tokens.append(int(out.logits[0, -1].argmax()))
    return Outcome(tokens, ttft, 0, fed)


def kvnotes_run(engine: Engine, case: PeerCase, skills: list[Notebook], repair: Repair, n: int,
                counter: FedCounter) -> tuple[Outcome, list[int]]:
    """``engine.compose`` of the case's compiled chunks; also the composed token ids."""
    counter.start()
    t0 = time.perf_counter()
    nb = engine.compose([case.header, *skills, case.tail], repair=repair)
    logits = engine.next_logits(nb)
    token = int(logits.argmax())
    ttft, fed = time.perf_counter() - t0, counter.fed
    counter.on = False
    tokens = engine.continue_greedy(nb, logits, n).token_ids if n > 1 else [token]
    reused = int(nb.meta.get("compose", {}).get("reused", 0))
    return Outcome(list(tokens), ttft, reused, fed), nb.token_ids.tolist()


def policy_of(method: str, best: str) -> str:
    name = {"kvnotes": "default", "kvnotes-best": best}.get(method, method.removeprefix("kvnotes:"))
    if name not in POLICIES:
        raise InvalidArgumentError(f"unknown kvnotes policy {name!r}; known: {', '.join(POLICIES)}")
    return name


def check_methods(methods: Sequence[str], best: str) -> None:
    for m in methods:
        if m == "recompute" or m in KVBOOST_METHODS:
            continue
        if m in ("kvnotes", "kvnotes-best") or m.startswith("kvnotes:"):
            policy_of(m, best)
            continue
        raise InvalidArgumentError(f"unknown method {m!r}; known: {', '.join(DEFAULT_METHODS)}, "
                                   f"kvnotes:<policy> ({', '.join(POLICIES)})")


class CaseRunner:
    """Runs one case's methods: compiles its chunks per policy once (kvnotes' warm-up)."""

    def __init__(self, engine: Engine, case: PeerCase, best: str, counter: FedCounter,
                 kvboost: KvboostClient | None) -> None:
        self.engine, self.case, self.best, self.counter, self.kvboost = (
            engine, case, best, counter, kvboost)
        bos = [engine.bos_id] if engine.adds_bos and engine.bos_id is not None else []
        self.ids = [*bos, *engine.encode(case.header),  # as compose lays the parts out
                    *(t for c in case.chunks for t in engine.encode(c)), *engine.encode(case.tail)]
        self.skills: dict[str, list[Notebook]] = {}
        self.same_ids: dict[str, bool] = {}

    def compiled(self, policy: str) -> list[Notebook]:
        if policy not in self.skills:
            rule = POLICIES[policy]
            behind = self.case.header if rule.behind else None
            if rule.seen:
                seen = list(self.case.seen or self.case.chunks)
                warm = dict(zip(seen, self.engine.compile_skills(
                    seen, names=[f"chunk{self.case.chunks.index(c)}" for c in seen],
                    after=behind), strict=True))
                self.skills[policy] = [warm[c] for c in self.case.chunks]
            else:
                self.skills[policy] = [self.engine.compile(c, name=f"chunk{i}", after=behind)
                                       for i, c in enumerate(self.case.chunks)]
        return self.skills[policy]

    def run(self, method: str, n: int) -> Outcome:
        if method == "recompute":
            return recompute(self.engine, self.ids, n, self.counter)
        if method in KVBOOST_METHODS:
            if self.kvboost is None:
                raise InvalidArgumentError("kvboost methods need the worker (--peers-python)")
            if method not in self.same_ids:
                got = self.kvboost.call({"op": "encode", "text": self.case.text})["ids"]
                self.same_ids[method] = got == self.ids
            seen = self.case.seen or self.case.chunks
            r = self.kvboost.call({"op": "run", "method": method, "prompt": self.case.text,
                                   "warm": [self.case.header + "".join(seen), *self.case.chunks],
                                   "max_new_tokens": n})
            return Outcome(r["tokens"], r["ttft_s"], r["reused"], r["fed"])
        policy = policy_of(method, self.best)
        out, ids = kvnotes_run(self.engine, self.case, self.compiled(policy),
                               POLICIES[policy].repair, n, self.counter)
        self.same_ids.setdefault(method, ids == self.ids)
        return out


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rounds(methods: Sequence[str], reps: int) -> list[tuple[int, list[str]]]:
    """Round 0 (greedy, warm-up) then ``reps`` timed rounds, the methods rotated each round."""
    k = len(methods)
    return [(r, [methods[(i + r) % k] for i in range(k)]) for r in range(reps + 1)]


Say = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class PeersConfig:
    """One run: ``cases`` cases of each workload from ``split``, ``reps`` timed rounds."""

    model: str = "smollm2-135m"
    split: str = "report"
    cases: int = 20
    reps: int = 5
    greedy_tokens: int = 16
    methods: tuple[str, ...] = DEFAULT_METHODS
    best: str = "anchor"
    workloads: tuple[str, ...] = ("tools", "tools-shuffled", "docs", "chat")
    threads: int | None = None
    peers_python: str = ".venv-peers/bin/python"
    max_prompt_tokens: int | None = None  # longer cases are left out (and counted)

    def __post_init__(self) -> None:
        check_methods(self.methods, self.best)
        if min(self.cases, self.reps, self.greedy_tokens) < 1:
            raise InvalidArgumentError("cases, reps and greedy_tokens must be at least 1")


def measure_case(runner: CaseRunner, config: PeersConfig, say: Say) -> list[CaseRow]:
    """Every method on one case: the greedy round, then the timed rounds."""
    case, engine = runner.case, runner.engine
    first: dict[str, Outcome] = {}
    times: dict[str, list[float]] = {m: [] for m in config.methods}
    for r, order in rounds(config.methods, config.reps):
        for m in order:
            out = runner.run(m, config.greedy_tokens if r == 0 else 1)
            if r == 0:
                first[m] = out
            else:
                times[m].append(out.ttft_s)
    ref = first["recompute"].tokens if "recompute" in first else None
    rows = []
    for m in config.methods:
        out = first[m]
        text = engine.decode([t for t in out.tokens if t not in engine.eos_ids])
        rows.append(CaseRow(
            case.id, case.workload, m, len(runner.ids),
            first_ok=ref is not None and out.tokens[:1] == ref[:1],
            greedy_ok=ref is not None and out.tokens == ref,
            correct=answer_ok(case.workload, text, case.answers),
            ttft_s=statistics.median(times[m]), ttfts=times[m], reused=out.reused, fed=out.fed,
            same_ids=runner.same_ids.get(m, True), text=text))
    say(f"{case.id}: " + ", ".join(f"{r.method} {'=' if r.greedy_ok else 'x'} "
                                   f"{1000 * r.ttft_s:.0f}ms" for r in rows))
    return rows
