"""The peers benchmark's prompts: each a header, the chunks a cache reuses, and a tail.

Three workloads, every prompt ``header + chunk_1 + ... + chunk_k + tail`` as text:

- ``tools``: BFCL v4 ``live_multiple`` development cases, each tool description a chunk, in
  the dataset's order (``tools``) and in a seeded shuffle (``tools-shuffled``); the answer is
  the function name BFCL's ground truth calls first.
- ``docs``: multi-document QA in RULER's task styles, generated here from a seed: a
  multi-key needle, a multi-value needle and variable tracking over 4-16 documents of 100-400
  tokens; each document a chunk, the answer written in exactly one of them.
- ``chat``: a conversation that grows turn by turn, each earlier turn a chunk; the last
  question asks for a fact one early turn gave.

The ``dev`` and ``report`` splits never share a case: BFCL cases alternate between them
(even positions are ``dev``), the generated ones take their seeds from disjoint ranges.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvnotes.core.chat import chat_frame, has_template, render
from kvnotes.core.errors import InvalidArgumentError

WORKLOADS = ("tools", "tools-shuffled", "docs", "chat")
SPLITS = ("dev", "report")
SEED_BASE = {"dev": 1_000, "report": 2_000}
DOC_TOKENS = (100, 400)
DOC_COUNT = (4, 16)
TASKS = ("multi-key", "multi-value", "variable-tracking")
_FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
           "There and back again.", "The river runs past the old mill.",
           "Nobody remembered who planted the orchard.", "The bell rang twice at noon.",
           "A cart of apples stood by the gate.", "The lamp in the window stayed lit.")
_WORDS = ("amber", "birch", "cobalt", "delta", "ember", "falcon", "garnet", "harbor", "ivory",
          "juniper", "kestrel", "lantern", "maple", "nimbus", "onyx", "pepper", "quartz",
          "raven", "saffron", "tundra", "umber", "violet", "willow", "zephyr")

TokenCount = Callable[[str], int]


@dataclass(frozen=True, slots=True)
class PeerCase:
    """One prompt: ``header + "".join(chunks) + tail``; ``answers``: any of them is right
    (empty: no task answer, identity only); ``seen``: the same chunks in the order an earlier
    request held them (empty: the order of ``chunks``), what a prefix cache was warmed on."""

    id: str
    workload: str
    header: str
    chunks: tuple[str, ...]
    tail: str
    answers: tuple[str, ...] = ()
    seen: tuple[str, ...] = ()

    @property
    def text(self) -> str:
        return self.header + "".join(self.chunks) + self.tail


def words(text: str) -> int:
    """A tokenizer-free count (whitespace words), for tests and rough sizing."""
    return len(text.split())


def split_seeds(split: str, n: int) -> list[int]:
    if split not in SPLITS:
        raise InvalidArgumentError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    return [SEED_BASE[split] + i for i in range(n)]


def _key(rng: random.Random) -> str:
    return f"{rng.choice(_WORDS)}-{rng.choice(_WORDS)}-{rng.randrange(100, 1000)}"


def _document(rng: random.Random, facts: Sequence[str], count: TokenCount) -> str:
    """Filler sentences around ``facts`` (each once, at random places), sized to a target
    drawn from :data:`DOC_TOKENS` by ``count``."""
    lo, hi = DOC_TOKENS
    target = rng.randint(lo, hi)
    sentences = list(facts)
    while count(" ".join(sentences)) < target:
        sentences.insert(rng.randrange(len(sentences) + 1), rng.choice(_FILLER))
    while count(" ".join(sentences)) > hi:
        filler = [i for i, s in enumerate(sentences) if s not in facts]
        if not filler:
            break
        sentences.pop(filler[-1])
    return " ".join(sentences)


def _needles(task: str, rng: random.Random, n_docs: int) -> tuple[list[list[str]], str, str]:
    """Each document's facts, the question and the answer of one RULER-style task."""
    facts: list[list[str]] = [[] for _ in range(n_docs)]
    where = rng.randrange(n_docs)
    if task == "variable-tracking":
        value = str(rng.randrange(10_000, 100_000))
        names = [f"V{x}" for x in rng.sample(range(1000, 10_000), min(n_docs, 5))]
        facts[where].append(f"VAR {names[0]} = {value}.")
        for prev, name in zip(names, names[1:], strict=False):
            facts[rng.randrange(n_docs)].append(f"VAR {name} = VAR {prev}.")
        return facts, f"What number does VAR {names[-1]} hold?", value
    keys = list(dict.fromkeys(_key(rng) for _ in range(3 * n_docs)))[:n_docs]
    for i, key in enumerate(keys):  # a distractor key in every document, the asked one once
        if i != where:
            facts[i].append(f"One special magic number for {key} is: {rng.randrange(10**6, 10**7)}.")
    value = str(rng.randrange(10**6, 10**7))
    asked = keys[where]
    facts[where].append(f"One special magic number for {asked} is: {value}.")
    if task == "multi-value":  # more values of the same key, in the same document
        facts[where] += [f"One special magic number for {asked} is: {rng.randrange(10**6, 10**7)}."
                         for _ in range(2)]
    return facts, f"What is a special magic number for {asked}?", value


def docs_case(seed: int, tokenizer: Any = None, count: TokenCount = words) -> PeerCase:
    """A multi-document QA case (task, document count and order all from ``seed``)."""
    rng = random.Random(seed)
    task = TASKS[seed % len(TASKS)]
    n_docs = rng.randint(*DOC_COUNT)
    facts, question, answer = _needles(task, rng, n_docs)
    docs = tuple(f"\n\n[Document {i + 1}]\n{_document(rng, f, count)}" for i, f in enumerate(facts))
    head, middle, tail = chat_frame(tokenizer) if tokenizer is not None else ("", "\n\n", "\nAnswer:")
    header = head + "Read the documents and answer the question with the number only."
    return PeerCase(f"docs-{task}-{seed}", "docs", header, docs,
                    middle + question + tail + "The answer is", (answer,),
                    tuple(rng.sample(docs, len(docs))))


def chat_case(seed: int, tokenizer: Any = None) -> PeerCase:
    """A conversation of 4-10 user/assistant turns; one early turn gives an order number the
    last question asks for."""
    rng = random.Random(seed)
    turns = rng.randint(4, 10)
    order = str(rng.randrange(10**5, 10**6))
    told = rng.randrange(turns - 1)
    msgs: list[dict[str, str]] = [{"role": "system", "content": "You are a shop's support agent."}]
    for t in range(turns):
        item = rng.choice(_WORDS)
        user = (f"My order number is {order}, it was the {item} lamp." if t == told else
                f"Do you sell a {item} {rng.choice(('lamp', 'chair', 'rug', 'kettle'))}?")
        msgs += [{"role": "user", "content": user},
                 {"role": "assistant", "content": f"Thanks for asking about the {item}. "
                  f"{rng.choice(_FILLER)} It ships in {rng.randint(2, 9)} days."}]
    msgs.append({"role": "user", "content": "What was my order number? Digits only."})
    cuts = [1, *range(3, len(msgs), 2)]
    if tokenizer is None or not has_template(tokenizer):
        pieces = [f"{m['role']}: {m['content']}\n" for m in msgs]
        texts = ["".join(pieces[:c]) for c in cuts] + ["".join(pieces) + "assistant:"]
    else:
        texts = [render(tokenizer, msgs[:c], generation_prompt=False) for c in cuts]
        texts.append(render(tokenizer, msgs, generation_prompt=True))
    if any(not b.startswith(a) for a, b in zip(texts, texts[1:], strict=False)):
        raise InvalidArgumentError("the chat template does not render a conversation's turns "
                                   "as prefixes of each other; it cannot be cut into chunks")
    chunks = tuple(b[len(a):] for a, b in zip(texts[:-2], texts[1:-1], strict=True))
    return PeerCase(f"chat-{seed}", "chat", texts[0], chunks,
                    texts[-1][len(texts[-2]):] + "Your order number is", (order,))


def tool_cases(split: str, n: int, tokenizer: Any, root: Any = None) -> list[PeerCase]:
    """``n`` BFCL ``live_multiple`` cases of ``split`` (spread over the file), each in the
    dataset's order and in a seeded shuffle."""
    from kvnotes_bench.tools.data import load_cases, spread
    from kvnotes_bench.tools.prompt import case_prompt

    split_seeds(split, 0)
    half = load_cases("live_multiple", root)[0 if split == "dev" else 1::2]
    out: list[PeerCase] = []
    for case in spread(half, n):
        p = case_prompt(tokenizer, case)
        out.append(PeerCase(case.id, "tools", p.header, p.skills, p.question + p.query,
                            case.answers))
        rng = random.Random(f"{SEED_BASE[split]}-{case.id}")
        shuffled = rng.sample(p.skills, len(p.skills))
        out.append(PeerCase(case.id + "-shuffled", "tools-shuffled", p.header,
                            tuple(shuffled), p.question + p.query, case.answers, p.skills))
    return out


def build_cases(split: str, n: int, tokenizer: Any, count: TokenCount) -> list[PeerCase]:
    """Every workload's ``n`` cases of ``split``."""
    seeds = split_seeds(split, n)
    return [*tool_cases(split, n, tokenizer), *(docs_case(s, tokenizer, count) for s in seeds),
            *(chat_case(s, tokenizer) for s in seeds)]
