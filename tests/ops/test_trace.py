"""Notes tracing: the patch loop's identities on tiny random models, plus one real-model smoke test."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_engine

import kvnotes
from kvnotes.core.document import Document, Field
from kvnotes.core.errors import KvnotesError
from kvnotes.core.metrics import normalized_effect
from kvnotes.eval.tasks import EditCase
from kvnotes.ops.trace import (
    TraceLengthError,
    TraceOptions,
    logit_difference,
    patch_metrics,
    splice,
    trace,
)
from kvnotes.research.trace.suite import bootstrap_mean, summarize, trace_cases

QUERY = " Question: which colour? Answer:"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # patching runs many tiny forwards: one thread avoids OpenMP spin-waits on shared cores
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _doc(value: str = "red") -> Document:
    return Document(["Record 12.\nColour: ", Field("colour", value),
                     "\nThe parcel was packed on Monday and left the depot on Tuesday.\n"])


@pytest.fixture(scope="module", params=["llama", "gemma3_text"])
def engine(request, tokenizer) -> kvnotes.Engine:
    return make_tiny_engine(request.param, tokenizer)


@pytest.fixture(scope="module")
def setup(engine):
    """Old/new notebooks, query ids and the answer pair that the field moves the most."""
    old_nb, new_nb = engine.prefill(_doc("red")), engine.prefill(_doc("blue"))
    query = engine.encode(QUERY)
    diff = engine.next_logits(new_nb, query) - engine.next_logits(old_nb, query)
    answers = (int(diff.argmax()), int(diff.argmin()))  # largest |m_new - m_old|
    return old_nb, new_nb, query, answers


def _effect(engine, setup, sites, direction="denoising") -> float:
    old_nb, new_nb, query, answers = setup
    metric = logit_difference(answers)
    m_old = metric(engine.next_logits(old_nb, query))
    m_new = metric(engine.next_logits(new_nb, query))
    base, source = (old_nb, new_nb) if direction == "denoising" else (new_nb, old_nb)
    (m,) = patch_metrics(engine, base, source, [sites], query, metric)
    e = normalized_effect(m, m_old, m_new)
    return e if direction == "denoising" else 1.0 - e


def _trace(engine, setup, **opts):
    answers = setup[3]
    return trace(engine, _doc("red"), field="colour", new_value="blue", query=QUERY,
                 answers=answers, options=TraceOptions(**opts))


def test_patching_every_site_reproduces_the_new_run(engine, setup):
    old_nb, new_nb, query, _ = setup
    everything = torch.ones(len(old_nb.layers), len(old_nb), dtype=torch.bool)
    hybrid = splice(old_nb, new_nb, everything)
    assert torch.allclose(engine.next_logits(hybrid, query), engine.next_logits(new_nb, query),
                          atol=1e-4)
    assert _effect(engine, setup, everything) == pytest.approx(1.0, abs=1e-4)


def test_patching_nothing_gives_zero(engine, setup):
    old_nb = setup[0]
    nothing = torch.zeros(len(old_nb.layers), len(old_nb), dtype=torch.bool)
    assert _effect(engine, setup, nothing) == pytest.approx(0.0, abs=1e-4)
    assert _effect(engine, setup, nothing, "noising") == pytest.approx(0.0, abs=1e-4)


def test_trace_field_and_notes_together_equal_the_full_patch(engine, setup):
    r = _trace(engine, setup, position_bins=3, grid_bins=2, grid_layer_groups=2)
    old_nb = setup[0]
    span = old_nb.span("colour")
    both = torch.zeros(len(old_nb.layers), len(old_nb), dtype=torch.bool)
    both[:, span.start:] = True  # field + every downstream note
    for direction in ("denoising", "noising"):
        full = getattr(r, direction).full
        assert full == pytest.approx(1.0, abs=1e-4)
        assert _effect(engine, setup, both, direction) == pytest.approx(full, abs=1e-4)
    assert abs(r.denominator) > 0.1
    assert r.field_effect == r.denoising.field and r.notes_effect == r.denoising.notes
    L = len(old_nb.layers)
    assert len(r.denoising.field_by_layer) == len(r.noising.notes_by_layer) == L
    assert len(r.denoising.notes_by_position) == 3 and r.positions[0][0] == span.end
    assert r.positions[-1][1] == len(old_nb)
    assert len(r.denoising.grid) == 2 and len(r.denoising.grid[0]) == 3
    data = json.loads(r.to_json())
    assert data["field_effect"] == pytest.approx(r.field_effect)
    assert data["denominator"] == pytest.approx(r.m_new - r.m_old)


def test_noising_is_one_minus_denoising_of_the_complement(engine, setup):
    old_nb = setup[0]
    span = old_nb.span("colour")
    L, n = len(old_nb.layers), len(old_nb)
    for lo, hi in [(span.start, span.end), (span.end, n)]:  # the field; the notes
        sites = torch.zeros(L, n, dtype=torch.bool)
        sites[:, lo:hi] = True
        noising = _effect(engine, setup, sites, "noising")
        assert noising == pytest.approx(1.0 - _effect(engine, setup, ~sites), abs=1e-4)
    r = _trace(engine, setup, by_layer=False)
    assert r.noising.field == pytest.approx(_effect(engine, setup, _field_sites(old_nb),
                                                    "noising"), abs=1e-5)
    # by definition: denoising reads (m - m_old)/d, noising (m_new - m)/d of the other splice
    (m,) = patch_metrics(engine, setup[1], setup[0], [_field_sites(old_nb)], setup[2],
                         logit_difference(setup[3]))
    assert r.noising.field == pytest.approx((r.m_new - m) / r.denominator, abs=1e-5)


def _field_sites(nb):
    span = nb.span("colour")
    sites = torch.zeros(len(nb.layers), len(nb), dtype=torch.bool)
    sites[:, span.start:span.end] = True
    return sites


def test_unequal_token_lengths_raise_a_clear_error(engine):
    with pytest.raises(TraceLengthError) as info:
        trace(engine, _doc("red"), field="colour", new_value="ultramarine turquoise",
              query=QUERY, answers=(" yes", " no"))
    msg = str(info.value)
    assert "equal token length" in msg and "'colour'" in msg and "line up token for token" in msg
    assert isinstance(info.value, KvnotesError)


def test_answers_sharing_a_first_token_are_refused(engine):
    with pytest.raises(KvnotesError, match="share their first token"):
        trace(engine, _doc("red"), field="colour", new_value="blue", query=QUERY,
              answers=("yes", "yes"))


def test_suite_counts_skipped_and_insensitive_cases(engine):
    def case(i, new):
        return EditCase("colours", f"c{i}", _doc("red"), "colour", "red", new,
                        "Which colour?", ("A", "B"), "A", "B")

    traces = trace_cases(engine, [case(0, "blue"), case(1, "ultramarine turquoise")],
                         TraceOptions(min_denominator=1e9, detail_when_insensitive=False))
    (row,) = summarize(traces, min_denominator=1e9)
    assert (row.n_cases, row.n_skipped_length, row.n_insensitive, row.n_sensitive) == (2, 1, 1, 0)
    assert row.field.n == 0 and traces[0].result.denoising.field_by_layer == []
    json.dumps([t.to_dict() for t in traces])


def test_bootstrap_mean_brackets_the_mean():
    est = bootstrap_mean([0.1, 0.2, 0.3, 0.9], n_boot=500)
    assert est.lo <= est.mean <= est.hi and est.n == 4
    assert bootstrap_mean([]).n == 0


def test_report_files(engine, tmp_path):
    from kvnotes.cli.trace import write_report

    def case(i):
        return EditCase("colours", f"c{i}", _doc("red"), "colour", "red", "blue",
                        "Which colour?", ("A", "B"), "A", "B")

    traces = trace_cases(engine, [case(0), case(1)],
                         TraceOptions(min_denominator=0.0, position_bins=2, grid_bins=2,
                                      grid_layer_groups=2))
    write_report(tmp_path, "tiny", traces, summarize(traces, min_denominator=0.0), 0.0)
    report = (tmp_path / "report.md").read_text()
    assert "| colours |" in report
    assert (tmp_path / "heatmap-colours.png").stat().st_size > 0
    (row,) = json.loads((tmp_path / "summary.json").read_text())["families"]
    assert row["family"] == "colours" and len(row["notes_by_position"]) == 2


@pytest.mark.real
def test_real_model_smoke(gemma3):
    from kvnotes.eval.tasks.recall import capital_recall_cases
    from kvnotes.research.trace.suite import case_inputs

    c = capital_recall_cases()[0]
    doc, query, answers = case_inputs(gemma3, c)
    r = trace(gemma3, doc, field=c.field, new_value=c.new_value, query=query, answers=answers,
              options=TraceOptions(by_layer=False, position_bins=2, directions=("denoising",)))
    assert r.denoising.full == pytest.approx(1.0, abs=1e-3)
    assert r.noising is None and len(r.denoising.notes_by_position) == 2
    assert abs(r.denominator) > 0
