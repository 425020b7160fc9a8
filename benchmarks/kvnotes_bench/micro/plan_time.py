"""Planning time of one request against skill catalogs of growing size (no HTTP, no vLLM).

What the front does for a request before it sends anything, timed in this process: the
registered texts found in the prompt, the parts tokenized alone, and the phase plan
(:func:`~kvnotes.serving.planning.request.read_request` with the catalog's ``find``, then
:func:`~kvnotes.serving.planning.front_plan.plan_request`), for three cases:

- ``text_warm``: a completion prompt of text, split at the registered texts it holds, its parts'
  ids kept between requests (:class:`~kvnotes.serving.planning.part_tokens.PartTokenCache`,
  as the front keeps them): only the new question is tokenized;
- ``text_cold``: the same with that cache emptied before each request: every part but the
  registered ones (which take their registered ids) is tokenized;
- ``ids``: the same prompt as the ids the front sends, split where the entries' ids occur.

The prompt (``--prompt-tokens``, about 4k) is a context of filler words with ``--in-prompt``
catalog entries spread through it, the last entry closing it, then a question: every timed
request ends with a new one (``--question-words`` random words of the vocabulary, never sent
before by any case), as a server sees the same long context with a new question. So the warm
case times what a repeated context costs, never a request seen whole before. The text prompt
with its new question tokenized whole, without the cache, is timed too: what any server pays
to read a text prompt, the floor under ``text_cold``.

Each catalog of ``--sizes`` entries holds the prompt's entries and synthetic others: texts of
words from the tokenizer's own vocabulary (their ids are the real tokenizer's), a quarter of
them opening as a tool's JSON does (learned tool chunks share a long prefix). Entries are held
in memory (:meth:`~kvnotes.serving.planning.match.SkillCatalog.of_pieces`): no KV is read, as
none is when a server plans. Each case runs once untimed (the catalog's view is built then, as
once per catalog change in a server, and the warm case's cache filled), then ``--repeats``
times; the JSON holds p50 and p90 per case, the machine record before and after (load average,
threads) and the command; the PNG plots them against the catalog's size.

    .venv/bin/python -m kvnotes_bench.micro.plan_time --out docs/results/plan-time
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import shlex
import statistics
import sys
import textwrap
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvnotes.core.document import encode
from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.machine import load_note, machine_info
from kvnotes.core.models import BUNDLED, kvnotes_home
from kvnotes.core.repair import Repair
from kvnotes.serving.library.splice import PieceInfo
from kvnotes.serving.planning.front_plan import catalog_view, plan_request
from kvnotes.serving.planning.match import SkillCatalog
from kvnotes.serving.planning.part_tokens import PartTokenCache
from kvnotes.serving.planning.request import read_request

PATHS = ("text_warm", "text_cold", "ids")
ROUNDS = 10  # interleaved rounds over the cases (see run)
TOOL_OPEN = '{"type": "function", "function": {"name": "'  # learned tool chunks open so
MODEL = "m"


@dataclass(frozen=True)
class PlanTimeConfig:
    """One run: ``model``'s tokenizer, catalogs of ``sizes`` entries, a prompt of about
    ``prompt_tokens`` tokens holding ``in_prompt`` entries and ending with a new question of
    ``question_words`` words each time, ``repeats`` timings per case."""

    model: str = "smollm2-135m"
    sizes: tuple[int, ...] = (10, 100, 1000, 10000)
    prompt_tokens: int = 4096
    in_prompt: int = 4
    repeats: int = 200
    block_size: int = 16
    repair_first: int = 16
    seed: int = 0
    question_words: int = 32

    def __post_init__(self) -> None:
        if not self.sizes or min(self.sizes) < self.in_prompt or self.in_prompt < 1:
            raise InvalidArgumentError(f"every catalog size must hold the {self.in_prompt} "
                                       f"entries of the prompt (at least 1), got {self.sizes}")
        if self.repeats < 1 or self.prompt_tokens < 64:
            raise InvalidArgumentError("repeats must be at least 1 and prompt_tokens at least 64")
        if not 1 <= self.question_words <= self.prompt_tokens // 2:
            raise InvalidArgumentError(f"question_words must be from 1 to half of prompt_tokens, "
                                       f"got {self.question_words}")


@dataclass(frozen=True)
class PlanTimeRow:
    """One case: a prompt kind (:data:`PATHS`) against a catalog of ``catalog_size`` entries."""

    path: str
    catalog_size: int
    p50_ms: float
    p90_ms: float
    repeats: int
    skills_found: int  # entries the plan splices (the prompt's, every time)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PlanTimeResult:
    config: PlanTimeConfig
    prompt_tokens: int  # the prompt's actual length, as sent
    rows: list[PlanTimeRow]
    machine_before: dict[str, Any]  # kvnotes.core.machine.machine_info records
    machine_after: dict[str, Any]
    load: str
    command: str
    date: str
    notes: list[str] = field(default_factory=list)
    # the text prompt with a new question tokenized whole, no catalog, no cache (what any
    # server pays to read a text prompt): the floor under text_cold's plan time
    tokenize_p50_ms: float | None = None
    question_tokens: int | None = None  # the first question's part, tokenized alone

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["config"]["sizes"] = list(self.config.sizes)
        return d


def load_tokenizer(model: str) -> Any:
    """A bundled model's tokenizer alone: from its converted folder, else from the GGUF's
    metadata (no weights read)."""
    from transformers import AutoTokenizer

    converted = kvnotes_home() / "models" / model
    if (converted / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(converted)
    if model not in BUNDLED:
        raise InvalidArgumentError(f"no converted folder for {model!r} and not a bundled "
                                   f"model ({', '.join(BUNDLED)})")
    gguf = BUNDLED[model].locate_gguf()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def word_ids(tokenizer: Any) -> list[int]:
    """Ids of the vocabulary's plain words (a space then lowercase letters): one token each."""
    ids = list(range(len(tokenizer)))
    texts = tokenizer.batch_decode([[i] for i in ids])
    return [i for i, t in zip(ids, texts, strict=True)
            if len(t) > 3 and t[0] == " " and t[1:].isalpha() and t[1:].islower()]


def entry_texts(tokenizer: Any, count: int, rng: random.Random) -> list[str]:
    """``count`` distinct entry texts of vocabulary words (a quarter opening as tool JSON)."""
    words = word_ids(tokenizer)
    texts: dict[str, None] = {}
    while len(texts) < count:
        body = tokenizer.decode(rng.sample(words, rng.randint(24, 96))).strip()
        if len(texts) % 4 == 3:
            body = f'{TOOL_OPEN}{body.split()[0]}", "description": "{body}"}}}}'
        texts.setdefault(body, None)
    return list(texts)


def catalog_of(tokenizer: Any, texts: Sequence[str]) -> SkillCatalog:
    origin = 1 if getattr(tokenizer, "add_bos_token", False) else 0
    pieces = [PieceInfo(f"entry{i:05d}", f"entry-{i}", tuple(encode(tokenizer, t)), origin)
              for i, t in enumerate(texts)]
    return SkillCatalog.of_pieces(tokenizer, pieces)


def prompt_text(tokenizer: Any, entries: Sequence[str], tokens: int, rng: random.Random) -> str:
    """About ``tokens`` tokens: filler words with ``entries`` spread between them, the last
    entry closing the text (each request's question follows it: :func:`questions`)."""
    words = word_ids(tokenizer)
    filler = max(0, tokens - sum(len(encode(tokenizer, e)) for e in entries))
    cuts = sorted(rng.randint(0, filler) for _ in entries[1:])
    out = []
    for i, (a, b) in enumerate(zip([0, *cuts], [*cuts, filler], strict=True)):
        out.append(tokenizer.decode([rng.choice(words) for _ in range(b - a)]))
        out.append(f"\n\n{entries[i]}" + ("\n\n" if i + 1 < len(entries) else ""))
    return "".join(out)


def questions(tokenizer: Any, count: int, words: int, rng: random.Random) -> list[str]:
    """``count`` distinct question parts: a blank line, ``words`` random words of the
    vocabulary, a question mark."""
    vocab = word_ids(tokenizer)
    out: dict[str, None] = {}
    while len(out) < count:
        out.setdefault(f"\n\n{tokenizer.decode(rng.sample(vocab, words)).strip()}?", None)
    return list(out)


def pct(values: list[float], q: int) -> float:
    """The ``q``-th percentile of ``values`` (inclusive: within their range)."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Case:
    """One timed case: ``plan`` plans the request ``prompt(i)`` (built untimed; ``i``: the
    request's number in this case, 0 the untimed first) and returns the skills it splices;
    ``before`` runs untimed before each request."""

    path: str
    catalog_size: int
    prompt: Callable[[int], str | list[int]]
    plan: Callable[[str | list[int]], int]
    before: Callable[[], None] = _nothing

    def call(self, i: int) -> tuple[float, int]:
        """``(seconds, skills spliced)`` of request ``i``."""
        prompt = self.prompt(i)
        self.before()
        t0 = time.perf_counter()
        found = self.plan(prompt)
        return time.perf_counter() - t0, found


def planner(tokenizer: Any, catalog: SkillCatalog, config: PlanTimeConfig,
            cache: PartTokenCache | None = None) -> Callable[[str | list[int]], int]:
    """One request's planning as the front does it (``cache``: the front's parts' ids);
    returns how many skills it splices."""
    repair = Repair(first=config.repair_first, align=config.block_size)
    find = catalog_view(catalog, None).find

    def plan(prompt: str | list[int]) -> int:
        req = read_request("completion", {"model": MODEL, "prompt": prompt}, tokenizer,
                           find=find, cache=cache)
        return len(plan_request(req, catalog, repair, config.block_size, None,
                                cache=cache).skills)
    return plan


def cases(tokenizer: Any, config: PlanTimeConfig, context: str, context_ids: list[int],
          catalogs: Mapping[int, SkillCatalog], asked: Sequence[str]) -> list[Case]:
    """Every case of ``config``, the text tokenized whole last. Each case asks its own
    questions (a slice of ``asked``, one per request): none was ever seen by a cache."""
    per = config.repeats + 1

    def text_of(qs: Sequence[str]) -> Callable[[int], str | list[int]]:
        return lambda i: context + qs[i]

    def ids_of(qs: Sequence[str]) -> Callable[[int], str | list[int]]:
        return lambda i: context_ids + encode(tokenizer, qs[i])

    def tokenize(text: str | list[int]) -> int:
        assert isinstance(text, str)
        return len(encode(tokenizer, text))

    out: list[Case] = []
    for size in config.sizes:
        for path in PATHS:
            qs = asked[len(out) * per:(len(out) + 1) * per]
            if path == "ids":
                out.append(Case(path, size, ids_of(qs), planner(tokenizer, catalogs[size], config)))
                continue
            cache = PartTokenCache()
            out.append(Case(path, size, text_of(qs),
                            planner(tokenizer, catalogs[size], config, cache),
                            cache.clear if path == "text_cold" else _nothing))
    out.append(Case("tokenize", 0, text_of(asked[len(out) * per:(len(out) + 1) * per]), tokenize))
    return out


def run(config: PlanTimeConfig, tokenizer: Any = None, command: str = "") -> PlanTimeResult:
    """Every case of ``config`` (``tokenizer``: the model's, loaded when None).

    The cases are timed interleaved: ``ROUNDS`` rounds, each timing every case in turn (the
    order rotated per round), so a machine whose speed drifts during the run (a shared VM)
    slows every catalog size alike instead of the ones timed last."""
    tokenizer = load_tokenizer(config.model) if tokenizer is None else tokenizer
    rng = random.Random(config.seed)
    texts = entry_texts(tokenizer, max(config.sizes), rng)
    context = prompt_text(tokenizer, texts[:config.in_prompt],
                          config.prompt_tokens - config.question_words, rng)
    asked = questions(tokenizer, (len(config.sizes) * len(PATHS) + 1) * (config.repeats + 1),
                      config.question_words, rng)
    before = machine_info()
    catalogs = {size: catalog_of(tokenizer, texts[:size]) for size in config.sizes}
    find = catalog_view(catalogs[config.sizes[0]], None).find
    context_ids = read_request("completion", {"model": MODEL, "prompt": context}, tokenizer,
                               find=find).prompt_ids
    ids = read_request("completion", {"model": MODEL, "prompt": context + asked[0]}, tokenizer,
                       find=find).prompt_ids
    if ids != context_ids + encode(tokenizer, asked[0]):
        raise AssertionError("the question is not a part of its own in the laid-out prompt")
    timed = cases(tokenizer, config, context, context_ids, catalogs, asked)
    found = [case.call(0)[1] for case in timed]  # untimed: views built, warm caches filled
    times: list[list[float]] = [[] for _ in timed]
    per_round = -(-config.repeats // ROUNDS)
    for r in range(ROUNDS):
        for k in range(len(timed)):
            i = (k + r) % len(timed)
            for _ in range(min(per_round, config.repeats - len(times[i]))):
                times[i].append(timed[i].call(len(times[i]) + 1)[0])
    rows = [PlanTimeRow(case.path, case.catalog_size, pct([1000 * t for t in ts], 50),
                        pct([1000 * t for t in ts], 90), len(ts), n_found)
            for case, ts, n_found in zip(timed, times, found, strict=True)
            if case.path != "tokenize"]
    after = machine_info(since=before)
    return PlanTimeResult(config, len(ids), rows, before, after, load_note(after), command,
                          datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                          tokenize_p50_ms=pct([1000 * t for t in times[-1]], 50),
                          question_tokens=len(encode(tokenizer, asked[0])))


def plot(result: PlanTimeResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind in PATHS:
        rows = sorted((r for r in result.rows if r.path == kind), key=lambda r: r.catalog_size)
        sizes = [r.catalog_size for r in rows]
        line = ax.plot(sizes, [r.p50_ms for r in rows], marker="o", label=f"{kind} p50")[0]
        ax.plot(sizes, [r.p90_ms for r in rows], marker="x", linestyle="--",
                color=line.get_color(), label=f"{kind} p90")
    if result.tokenize_p50_ms is not None:
        ax.axhline(result.tokenize_p50_ms, color="grey", linestyle=":",
                   label="text prompt tokenized whole, no cache, p50")
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("catalog entries")
    ax.set_ylabel("plan time per request (ms)")
    question = "" if result.question_tokens is None else \
        f", a new {result.question_tokens}-token question each time"
    ax.set_title(f"planning a {result.prompt_tokens}-token prompt ({result.config.model}"
                 f"{question})\n{textwrap.fill(result.load, 100)}", fontsize=7)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def read_result(d: Mapping[str, Any]) -> PlanTimeResult:
    """A result from its JSON form (:meth:`PlanTimeResult.to_dict`)."""
    config = PlanTimeConfig(**{**d["config"], "sizes": tuple(d["config"]["sizes"])})
    rows = [PlanTimeRow(**r) for r in d["rows"]]
    return PlanTimeResult(**{**d, "config": config, "rows": rows})


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", default=PlanTimeConfig.model)
    parser.add_argument("--sizes", default="10,100,1000,10000", help="catalog sizes")
    parser.add_argument("--prompt-tokens", type=int, default=PlanTimeConfig.prompt_tokens)
    parser.add_argument("--in-prompt", type=int, default=PlanTimeConfig.in_prompt,
                        help="catalog entries the prompt holds")
    parser.add_argument("--repeats", type=int, default=PlanTimeConfig.repeats)
    parser.add_argument("--question-words", type=int, default=PlanTimeConfig.question_words,
                        help="random vocabulary words in each request's new question")
    parser.add_argument("--out", type=Path, default=Path("docs/results/plan-time"))
    args = parser.parse_args(argv)
    config = PlanTimeConfig(model=args.model, sizes=tuple(int(s) for s in args.sizes.split(",")),
                            prompt_tokens=args.prompt_tokens, in_prompt=args.in_prompt,
                            repeats=args.repeats, question_words=args.question_words)
    command = shlex.join([sys.executable, "-m", __spec__.name if __spec__ else __name__,
                          *(sys.argv[1:] if argv is None else argv)])
    result = run(config, command=command)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / "plan-time"
    stem.with_suffix(".json").write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    plot(result, stem.with_suffix(".png"))
    print(f"wrote {stem}.json and .png; {result.load}")


if __name__ == "__main__":
    main()
