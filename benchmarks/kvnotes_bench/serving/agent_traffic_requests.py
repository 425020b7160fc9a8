"""What ``serve-bench agent`` sends: agent traffic as OpenAI chat requests.

Two development sets, both turned into plain OpenAI chat bodies (what an agent framework sends,
no kvnotes registration):

- ``tools``: BFCL ``live_multiple`` development cases (:mod:`kvnotes_bench.tools.data`): a
  system and a user message, the case's functions as ``tools=[{"type": "function",
  "function": {name, description, parameters}}]``. BFCL writes its parameter schemas in its own
  type names (``dict``, ``float``, ``tuple``, ...): :func:`json_schema` maps them to JSON
  Schema's, as BFCL's own OpenAI handler does, and dots in a function name become ``_`` (OpenAI
  names allow ``[A-Za-z0-9_-]``).
- ``documents``: the airline agent's policy documents (:func:`~kvnotes_bench.serving.prompt_sets.skill_texts`)
  sent as a user message's content parts, ``k`` of them in a seeded random subset and order,
  the customer's question as the last part.

:meth:`AgentRequest.reordered` gives the same request with its chunks (tools or document parts)
in another order: a fixed, seeded permutation (:func:`permutation`) that never is the identity
when there are two chunks or more. Pure functions: nothing here talks to a server.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvnotes.core.errors import InvalidArgumentError

KINDS = ("tools", "documents")
DEFAULT_SYSTEM = "You are a helpful assistant. Call one of the given functions to answer."
DOCS_SYSTEM = ("You are an airline customer support agent. Answer from the policy documents "
               "the customer's message comes with.")
# BFCL's type names -> JSON Schema's (BFCL's own OpenAI conversion, GORILLA_TO_OPENAPI)
BFCL_TYPES = {
    "dict": "object", "object": "object", "HashMap": "object", "Hashtable": "object",
    "float": "number", "double": "number", "number": "number",
    "integer": "integer", "int": "integer", "long": "integer", "short": "integer",
    "byte": "integer", "Bigint": "integer",
    "string": "string", "String": "string", "char": "string", "any": "string", "Any": "string",
    "boolean": "boolean", "bool": "boolean",
    "array": "array", "list": "array", "tuple": "array", "ArrayList": "array",
    "Array": "array", "Queue": "array", "Stack": "array",
}


def json_schema(schema: Any) -> Any:
    """A BFCL parameter schema with every ``type`` in JSON Schema's names (recursively through
    ``properties``, ``items`` and ``additionalProperties``); other keys are kept as they are.

    Example:
        >>> s = json_schema({"type": "dict", "properties": {"x": {"type": "float"},
        ...                  "l": {"type": "tuple", "items": {"type": "dict"}}}})
        >>> s["type"], s["properties"]["x"], s["properties"]["l"]
        ('object', {'type': 'number'}, {'type': 'array', 'items': {'type': 'object'}})
    """
    if isinstance(schema, list):
        return [json_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "type" and isinstance(value, str):
            out[key] = BFCL_TYPES.get(value, value)
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: json_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties"):
            out[key] = json_schema(value)
        else:
            out[key] = value
    return out


def tool_name(name: str) -> str:
    """A BFCL function name as an OpenAI tool name (dots are not allowed there)."""
    return name.replace(".", "_")


def openai_tool(function: Mapping[str, Any]) -> dict[str, Any]:
    """One BFCL function document as an OpenAI ``tools`` entry.

    Example:
        >>> t = openai_tool({"name": "a.b", "description": "d", "parameters": {"type": "dict",
        ...                  "properties": {}}})
        >>> t["type"], t["function"]["name"], t["function"]["parameters"]
        ('function', 'a_b', {'type': 'object', 'properties': {}})
    """
    if "name" not in function:
        raise InvalidArgumentError(f"a BFCL function without a name: {sorted(function)}")
    params = function.get("parameters") or {"type": "dict", "properties": {}}
    return {"type": "function", "function": {
        "name": tool_name(str(function["name"])),
        "description": str(function.get("description", "")),
        "parameters": json_schema(params)}}


def permutation(n: int, seed: int | str) -> list[int]:
    """A fixed order of ``n`` items for ``seed``: never the identity when ``n >= 2``.

    Example:
        >>> p = permutation(4, "case-1"); sorted(p) == [0, 1, 2, 3] and p != [0, 1, 2, 3]
        True
    """
    order = list(range(n))
    if n < 2:
        return order
    rng = random.Random(f"kvnotes-agent-order:{seed}")
    for _ in range(64):
        rng.shuffle(order)
        if order != sorted(order):
            return order
    return order[::-1]  # only reached for tiny n with an unlucky stream


@dataclass(frozen=True)
class AgentRequest:
    """One chat request of a development set.

    ``chunks`` are what kvnotes may cache on sight, in the request's order: the ``tools``
    entries (kind ``tools``) or the user message's document parts (kind ``documents``, the last
    content part, the question, is not one). ``answers`` are the tool names the case's ground
    truth accepts (BFCL), ``candidates`` every tool the request offers.
    """

    id: str
    kind: str
    system: str
    question: str
    chunks: tuple[Any, ...]  # tool dicts or document strings
    answers: tuple[str, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgumentError(f"request kind {self.kind!r}: use one of "
                                       f"{', '.join(KINDS)}")

    @property
    def candidates(self) -> tuple[str, ...]:
        if self.kind != "tools":
            return ()
        return tuple(t["function"]["name"] for t in self.chunks)

    def messages(self) -> list[dict[str, Any]]:
        """The chat messages (a system turn, then the user's)."""
        if self.kind == "tools":
            user: Any = self.question
        else:
            user = [{"type": "text", "text": d} for d in self.chunks] + [
                {"type": "text", "text": self.question}]
        return [{"role": "system", "content": self.system}, {"role": "user", "content": user}]

    def tools(self) -> list[dict[str, Any]] | None:
        return list(self.chunks) if self.kind == "tools" else None

    def body(self) -> dict[str, Any]:
        """``messages`` and, for the tools set, ``tools``: the request's own content."""
        out: dict[str, Any] = {"messages": self.messages()}
        tools = self.tools()
        if tools is not None:
            out["tools"] = tools
        return out

    def reordered(self, seed: int | str) -> AgentRequest:
        """The same request, its chunks in :func:`permutation` order for ``(seed, id)``."""
        order = permutation(len(self.chunks), f"{seed}:{self.id}")
        return replace(self, chunks=tuple(self.chunks[i] for i in order),
                       meta={**self.meta, "order": order})

    def variant(self, tag: str) -> AgentRequest:
        """The same request with ``tag`` written into every chunk (a tool's description, a
        document's first line): chunks no server has seen, of about the same length."""
        if self.kind == "tools":
            chunks: tuple[Any, ...] = tuple(
                {**t, "function": {**t["function"], "description":
                                   f"[{tag}] {t['function']['description']}"}}
                for t in self.chunks)
        else:
            chunks = tuple(f"[{tag}]\n{d}" for d in self.chunks)
        return replace(self, id=f"{self.id}~{tag}", chunks=chunks)


def tool_requests(cases: Sequence[Any], *, min_tools: int = 2) -> list[AgentRequest]:
    """BFCL ``live_multiple`` cases (:class:`~kvnotes_bench.tools.data.ToolCase`) as requests;
    cases with fewer than ``min_tools`` functions are left out (no other order exists)."""
    out = []
    for case in cases:
        functions = case.meta.get("functions") or []
        if len(functions) < min_tools:
            continue
        out.append(AgentRequest(
            id=case.id, kind="tools", system=case.system or DEFAULT_SYSTEM,
            question=case.question, chunks=tuple(openai_tool(f) for f in functions),
            answers=tuple(tool_name(a) for a in case.answers)))
    return out


def document_requests(documents: Mapping[str, str], n: int, k: int, seed: int,
                      question: Any = None) -> list[AgentRequest]:
    """``n`` requests of ``k`` documents each (a seeded random subset and order of
    ``documents``), each with its own customer question (``question(rng)``: the airline
    prompts' :func:`~kvnotes_bench.serving.prompt_sets.user_text` by default)."""
    if not 2 <= k <= len(documents):
        raise InvalidArgumentError(f"--docs-k {k}: use 2 to {len(documents)} documents")
    if question is None:
        from kvnotes_bench.serving.prompt_sets import user_text as question
    rng = random.Random(f"kvnotes-agent-docs:{seed}")
    names = sorted(documents)
    out = []
    for i in range(n):
        chosen = rng.sample(names, k)
        out.append(AgentRequest(
            id=f"docs-{seed}-{i}", kind="documents", system=DOCS_SYSTEM,
            question=str(question(rng)).strip(), chunks=tuple(documents[c] for c in chosen),
            meta={"documents": chosen}))
    return out


def tool_pool(requests: Sequence[AgentRequest]) -> list[dict[str, Any]]:
    """Every distinct tool of ``requests`` (by name, first seen kept), in order."""
    seen: dict[str, dict[str, Any]] = {}
    for r in requests:
        for t in r.chunks if r.kind == "tools" else ():
            seen.setdefault(t["function"]["name"], t)
    return list(seen.values())


def subset_request(pool: Sequence[dict[str, Any]], questions: Sequence[str], rng: random.Random,
                   *, k: tuple[int, int], index: int) -> AgentRequest:
    """A request of ``k[0]..k[1]`` tools drawn from ``pool`` in random order and one of
    ``questions`` (the soak's traffic: random tool subsets)."""
    lo, hi = k
    if not 1 <= lo <= hi <= len(pool):
        raise InvalidArgumentError(f"tools per request {lo}..{hi}: the pool has {len(pool)}")
    tools = rng.sample(list(pool), rng.randint(lo, hi))
    return AgentRequest(id=f"soak-{index}", kind="tools", system=DEFAULT_SYSTEM,
                        question=rng.choice(list(questions)), chunks=tuple(tools))
