"""The agent soak's per-request record: one JSON line per request in the run's bundle.

A :class:`SoakRequestRecord` holds what it takes to look at one answer again, or check it again
without a server (:func:`~kvnotes_bench.serving.agent_traffic_check.check_request` over the
run's kept entries): who sent it (client, tenant, ``splice``), the prompt ids the check rendered
(:func:`~kvnotes_bench.serving.agent_traffic_render.rendered_prompt`: the model's own chat
template) and the count the server reported, the stop strings, the answer's ``usage.kvnotes``
(the plan and the connector's reports, as JSON), the answer's token strings, per-step margins, text and
finish reason, and the verdict (matched reference, where it diverged, the expected ids, both
sides' margins there, or why it is unchecked).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvnotes_bench.kit.records import Record
from kvnotes_bench.serving.agent_traffic_client import Answer

RECORDS_NAME = "soak-requests.jsonl"


@dataclass
class SoakRequestRecord(Record):
    """One soak request, its prompt as the check rebuilt it, its answer and its verdict."""

    index: int
    client: int
    sent_s: float  # seconds into the run
    tenant: str | None
    splice: bool
    eligible: bool
    tools: list[str]
    question: int
    ok: bool
    error: str | None = None
    prompt_ids: list[int] | None = None  # None: the prompt could not be rendered
    prompt_source: str | None = None  # "template": the model's own chat template
    prompt_tokens: int | None = None  # the server's count
    stop: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None  # usage.kvnotes as sent (None: the front sent none)
    spliced_tokens: int = 0
    tokens: list[str] = field(default_factory=list)
    margins: list[float | None] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    verdict: dict[str, Any] | None = None

    def answer(self) -> Answer:
        """The answer as the check reads it."""
        return Answer(ok=self.ok, error=self.error, text=self.text, tokens=list(self.tokens),
                      margins=list(self.margins), prompt_tokens=self.prompt_tokens,
                      spliced_tokens=self.spliced_tokens,
                      kvnotes=self.usage,
                      finish_reason=self.finish_reason)


def write_records(records: Iterable[SoakRequestRecord], path: Path) -> Path:
    """``records`` as JSON lines (one per request, in the order given)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r.to_dict(), ensure_ascii=False) + "\n")
    return path
