"""The edit section of `kvnotes demo`: one record, one field change, every strategy side by side."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvnotes.core.engine import Engine

if TYPE_CHECKING:
    from rich.console import Console


def edit_section(engine: Engine, console: Console | None = None, case_id: str = "refund-000") -> list[str]:
    """Run every edit strategy on one bundled case; print a table; return markdown lines."""
    from kvnotes.eval.tasks import load_suite
    from kvnotes.research.edit.evaluate import compare_strategies

    case = next(c for c in load_suite(["refund"]) if c.case_id == case_id)
    rows = compare_strategies(engine, case)
    lines = [
        "",
        "## Editing a field",
        "",
        f"Case `{case.case_id}`: field `{case.field}` changes from `{case.old_value}` to "
        f"`{case.new_value}`; question: *{case.question}* Each strategy is compared with a full "
        "recompute of the edited record (decision = the answer whose first token has the higher "
        "logit).",
        "",
        "| strategy | decision | same as recompute | logit cosine | KL | tokens recomputed |"
        " compute fraction | seconds |",
        "|---|---|:---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.strategy} | {r.decision} | {'yes' if r.identical else 'NO'}"
            f" | {_num(r.cosine, 4)} | {_num(r.kl, 4)} | {r.tokens_recomputed}"
            f" | {_num(r.compute_fraction, 3)} | {_num(r.seconds, 2)} |")
    if console is not None:
        from rich.table import Table

        table = Table(title=f"edit {case.field}: {case.old_value} -> {case.new_value}")
        for col in ("strategy", "decision", "same as recompute", "logit cos", "KL",
                    "recomputed", "compute frac", "seconds"):
            table.add_column(col)
        for r in rows:
            table.add_row(r.strategy, str(r.decision), "yes" if r.identical else "NO",
                          _num(r.cosine, 4), _num(r.kl, 4), str(r.tokens_recomputed),
                          _num(r.compute_fraction, 3), _num(r.seconds, 2))
        console.print(table)
    return lines


def _num(x: float | None, digits: int) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"
