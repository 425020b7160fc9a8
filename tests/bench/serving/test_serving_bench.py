"""serve-bench without vLLM: workload generator, /metrics parsing, client errors, server
lifecycle and the whole benchmark against a small fake OpenAI-compatible server."""

from __future__ import annotations

import json
import math
import re
import socket
import sys
import textwrap
from pathlib import Path

import pytest

from kvnotes.core.errors import InvalidArgumentError, ServingError, UnknownNameError
from kvnotes.ops.decisions import parse_answer
from kvnotes.ops.edit import erratum_text
from kvnotes.serving.launch.process import VLLMServer, find_vllm_python
from kvnotes.serving.vllm_endpoints import info_labels
from kvnotes_bench.kit.stats import percentile
from kvnotes_bench.serving.client import Client, check_loopback_url
from kvnotes_bench.serving.erratum import (
    ErratumBenchConfig,
    matrix_config,
    run_benchmark,
    validate_block_size,
)
from kvnotes_bench.serving.metrics import (
    HISTOGRAMS,
    PrefixCacheCounters,
    agreement,
    parse_prometheus,
    ttft_breakdown,
)
from kvnotes_bench.serving.report import report_markdown, write_outputs
from kvnotes_bench.serving.workload import (
    ANSWERS,
    MAX_EDITS,
    REASK,
    REFUND_STATUSES,
    make_session,
    make_sessions,
)

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
import _fake_vllm  # noqa: E402


def whitespace_tokens(text: str) -> int:
    """A crude token count (words and punctuation)."""
    return len(re.findall(r"\w+|[^\w\s]", text))


def _bench(client, config):
    """A run's JSON form, as result.json holds it."""
    return run_benchmark(client, config, log=lambda s: None).to_dict()


def _session(**kw):
    args = dict(context_tokens=1000, depth=0.1, edits=4, count_tokens=whitespace_tokens)
    return make_session("t-s0", **{**args, **kw})


# ---------------------------------------------------------------- workload


@pytest.mark.parametrize("ctx", [500, 1000, 4000])
@pytest.mark.parametrize("depth", [0.1, 0.5, 0.9])
def test_session_fills_budget_and_places_field(ctx, depth):
    s = _session(context_tokens=ctx, depth=depth)
    assert 0.9 * ctx <= s.context_tokens <= ctx + 5
    assert s.context_tokens == whitespace_tokens(s.context())
    assert abs(s.field_token_depth - depth) < 0.08


def test_prompts_per_policy():
    s = _session(edits=3, errata="append")
    ctx = s.context()
    for k, turn in enumerate(s.turns):
        erratum = s.prompt("erratum", k)
        in_place = s.prompt("in-place", k)
        # erratum: the old context byte-identical, then one correction per edit so far
        assert erratum.startswith(ctx + "\n\n")
        assert erratum.count("Correction:") == k + 1
        assert erratum_text(s.field_label, turn.old, turn.new) in erratum
        assert erratum.endswith(s.question)
        # in-place: the same text up to the field, then the new value
        assert in_place.startswith(s.before + turn.new)
        assert in_place == f"{s.context(turn.new)}\n\n{s.question}"
        assert s.prompt("cold", k) == in_place
        if k:  # append-only: this request extends the previous one's errata
            prev = s.prompt("erratum", k - 1)
            assert erratum.startswith(prev[: prev.index("\n\nQuestion:")])
    assert s.warmup_prompt().startswith(ctx)
    with pytest.raises(UnknownNameError) as err:
        s.prompt("magic", 0)
    assert str(err.value) == "unknown policy 'magic'; valid policies: in-place, erratum, cold"
    assert isinstance(err.value, ValueError)


def test_erratum_wording():
    assert erratum_text("status of order #1", "pending", "delivered") == (
        "Correction: the status of order #1 is delivered, not pending.")


def test_edit_stream_brings_new_values_and_flips_decisions():
    s = _session(edits=MAX_EDITS)
    values = [s.initial] + [t.new for t in s.turns]
    assert len(set(values)) == len(values)  # an in-place prompt is never one already sent
    for a, b in zip(s.turns, s.turns[1:], strict=False):
        assert b.old == a.new
    assert {t.expected for t in s.turns} == {"yes", "no"}
    first = s.turns[0]
    assert (first.new in REFUND_STATUSES) != (first.old in REFUND_STATUSES)


def test_sessions_deterministic_and_distinct():
    a = make_sessions(3, context_tokens=300, depth=0.1, edits=2, count_tokens=whitespace_tokens,
                      tag="r1")
    b = make_sessions(3, context_tokens=300, depth=0.1, edits=2, count_tokens=whitespace_tokens,
                      tag="r1")
    c = make_sessions(3, context_tokens=300, depth=0.1, edits=2, count_tokens=whitespace_tokens,
                      tag="r2")
    assert [x.context() for x in a] == [x.context() for x in b]
    assert len({x.context()[:40] for x in a + c}) == 6  # ids differ in the first line


@pytest.mark.parametrize("kw,msg", [(dict(context_tokens=10), "at least 64"),
                                    (dict(depth=1.5), "depth"),
                                    (dict(edits=0), "edits"),
                                    (dict(edits=MAX_EDITS + 1), "edits")])
def test_session_bad_arguments(kw, msg):
    with pytest.raises(ValueError, match=msg):
        _session(**kw)


@pytest.mark.parametrize("text,want", [("Yes.", "yes"), (" no, because", "no"),
                                       ("Answer: YES", "yes"), ("nothing", None),
                                       ("No. Yes.", "no"), ("yesterday", None)])
def test_parse_answer_reads_served_decisions(text, want):
    assert parse_answer(text, ANSWERS) == want


# ---------------------------------------------------------------- metrics

METRICS = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1200.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 800.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 900.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7959896329540029e+09
vllm:num_requests_running{engine="0",model_name="m"} 0.0
# HELP http_requests_total with a brace and a quote inside a label value
http_requests_total{handler="/v1/{x}",note="say \\"hi\\""} 7.0
process_open_fds 31.0
vllm:gpu_cache_usage_perc NaN
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{engine="0",le="0.5",model_name="m"} 3.0
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 4.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 1.5
vllm:cache_config_info{block_size="64",cache_dtype="auto",engine="0"} 1.0
"""


def test_parse_prometheus_sums_label_sets():
    m = parse_prometheus(METRICS)
    assert m["vllm:prefix_cache_queries_total"] == 2000.0
    assert m["vllm:prefix_cache_hits_total"] == 900.0
    assert m["process_open_fds"] == 31.0
    assert m["http_requests_total"] == 7.0  # a hand-written regex stops at the brace
    assert m["vllm:prefix_cache_queries_created"] == pytest.approx(1.7959896e9)
    assert m["vllm:request_queue_time_seconds_sum"] == 1.5
    assert m["vllm:request_queue_time_seconds_count"] == 4.0
    assert not any(k.endswith("_bucket") for k in m)  # buckets are per `le`: never summed
    assert math.isnan(m["vllm:gpu_cache_usage_perc"])
    assert info_labels(METRICS)["block_size"] == "64"
    assert info_labels("not metrics at all") == {}


def test_metrics_parsed_by_prometheus_client(monkeypatch):
    import kvnotes_bench.serving.metrics as metrics_mod

    assert not hasattr(metrics_mod, "_SAMPLE")  # the hand-written parser is gone
    calls = []
    real = metrics_mod.text_string_to_metric_families

    def spy(text):
        calls.append(text)
        return real(text)

    monkeypatch.setattr(metrics_mod, "text_string_to_metric_families", spy)
    parse_prometheus(METRICS)
    assert calls == [METRICS]
    with pytest.raises(ServingError, match="not Prometheus text"):
        parse_prometheus("broken line without value\n")


def test_prefix_cache_counters_delta():
    before = PrefixCacheCounters.from_metrics(METRICS)
    after = PrefixCacheCounters.from_metrics(
        METRICS.replace("1200.0", "2200.0").replace("900.0", "1880.0"))
    d = after - before
    assert (d.queries, d.hits) == (1000.0, 980.0)
    assert d.hit_rate == pytest.approx(0.98)
    assert PrefixCacheCounters(0, 0).hit_rate is None
    with pytest.raises(KeyError, match="prefix_cache_hits_total"):
        PrefixCacheCounters.from_metrics("vllm:prefix_cache_queries_total 1\n")


def _hist(**means):
    """A parsed snapshot: every histogram of HISTOGRAMS observed 4 times with these means."""
    out = {}
    for key, name in HISTOGRAMS.items():
        out[f"{name}_sum"], out[f"{name}_count"] = 4 * means.get(key, 0.0), 4.0
    return out


def test_ttft_breakdown_from_histogram_deltas():
    before = _hist(queue_s=9.0)  # earlier phases: only the delta counts
    after = {k: before[k] + v for k, v in _hist(
        server_ttft_s=0.30, queue_s=0.05, prefill_s=0.22, decode_step_s=0.04,
        computed_tokens=150, prompt_tokens=8100).items()}
    b = ttft_breakdown(before, after, client_ttft_mean_s=0.35)
    assert b["n"] == 4
    assert b["queue_s"] == pytest.approx(0.05)
    assert b["prefill_s"] == pytest.approx(0.22)
    assert b["first_step_s"] == pytest.approx(0.04)
    assert b["compute_s"] == pytest.approx(0.18)
    assert b["frontend_s"] == pytest.approx(0.05)
    assert b["computed_tokens"] == pytest.approx(150) and b["prompt_tokens"] == 8100
    # a server without these histograms: every figure None, nothing raised
    empty = ttft_breakdown({}, {}, client_ttft_mean_s=0.3)
    assert empty["queue_s"] is None and empty["compute_s"] is None and empty["n"] is None
    # nothing observed in between: no mean
    assert ttft_breakdown(before, before, client_ttft_mean_s=None)["prefill_s"] is None


def test_percentile_and_agreement():
    xs = [float(i) for i in range(1, 11)]
    assert percentile(xs, 50) == pytest.approx(5.5)
    assert percentile(xs, 90) == pytest.approx(9.1)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 10.0
    assert percentile([], 50) is None
    assert agreement({1: "yes", 2: "no", 3: None}, {1: "yes", 2: "yes", 3: None, 4: "no"}) == (2, 3)


# ---------------------------------------------------------------- client and server errors


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("url", ["http://10.0.0.5:8000", "http://example.com", "ftp://127.0.0.1",
                                 "127.0.0.1:8000"])
def test_only_loopback_urls(url):
    with pytest.raises(ServingError):
        check_loopback_url(url)


def test_loopback_urls_accepted():
    assert check_loopback_url("http://127.0.0.1:8000/")[:2] == ("127.0.0.1", 8000)
    assert check_loopback_url("http://localhost:1234")[1] == 1234
    assert check_loopback_url("http://[::1]:99")[0] == "::1"


def test_wrong_url_is_a_clear_error():
    client = Client(f"http://127.0.0.1:{_closed_port()}", timeout=5)
    assert not client.healthy()
    with pytest.raises(ServingError, match="cannot reach the server"):
        run_benchmark(client, ErratumBenchConfig(context_tokens=(100,), sessions=1, edits=1,
                                          concurrency=(1,)), log=lambda s: None)


def test_model_not_served_lists_served_models(fake_server):
    url, _ = fake_server
    with pytest.raises(ServingError, match=r"does not serve 'other'.*smollm2-135m"):
        run_benchmark(Client(url), ErratumBenchConfig(model="other", context_tokens=(100,)),
                      log=lambda s: None)


def test_context_longer_than_the_server_allows(fake_server):
    url, state = fake_server
    state.max_model_len = 1024
    with pytest.raises(ServingError, match="max model length is 1024"):
        run_benchmark(Client(url), ErratumBenchConfig(context_tokens=(1000,)), log=lambda s: None)
    assert state.requests == 0  # refused before any request was sent


def test_context_limit_checked_on_the_measured_prompts(fake_server, monkeypatch):
    import kvnotes_bench.serving.erratum as bench

    url, state = fake_server
    monkeypatch.setattr(bench.secrets, "token_hex", lambda n: "abcdef")  # same sessions
    config = _small(edits=4)
    longest = max(len(_fake_vllm.tokens(p)) for p in _all_prompts(url, config))
    state.max_model_len = longest + bench.TEMPLATE_MARGIN + config.max_tokens  # just fits
    result = _bench(Client(url), config)
    assert result["summaries"][0]["ok"] == 4
    state.max_model_len -= 1
    with pytest.raises(ServingError, match=r"the longest prompt needs about"):
        run_benchmark(Client(url), config, log=lambda s: None)


def _all_prompts(url, config):
    """The longest prompts a run of ``config`` with run id "abcdef" sends."""
    count = Client(url).count_tokens
    sessions = make_sessions(1, context_tokens=200, depth=config.field_depth, edits=config.edits,
                             count_tokens=lambda t: count("smollm2-135m", t), tag="abcdef-c200-k1")
    return [s.prompt(p, config.edits - 1) for s in sessions for p in ("erratum", "in-place")]


def test_missing_vllm_environment_says_make_vllm(tmp_path):
    with pytest.raises(ServingError, match="make vllm"):
        find_vllm_python(tmp_path / "nope" / "python")


def _module(tmp_path: Path, name: str, body: str) -> dict[str, str]:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    return {"PYTHONPATH": str(tmp_path)}


def test_failed_start_reports_log_tail(tmp_path):
    env = _module(tmp_path, "broken_vllm", """\
        import sys
        print("loading model")
        print("RuntimeError: operator torchvision::nms does not exist", flush=True)
        sys.exit(3)
        """)
    server = VLLMServer(tmp_path, served_name="m", python=sys.executable, module="broken_vllm",
                        env=env, log_path=tmp_path / "server.log")
    with pytest.raises(ServingError, match=r"(?s)exited with code 3.*torchvision::nms"):
        with server:
            pass
    assert server.alive_pids() == []


def test_start_timeout_stops_the_server(tmp_path):
    env = _module(tmp_path, "slow_vllm", """\
        import time
        print("compiling forever", flush=True)
        time.sleep(600)
        """)
    server = VLLMServer(tmp_path, served_name="m", python=sys.executable, module="slow_vllm",
                        env=env, log_path=tmp_path / "server.log", startup_timeout=3)
    with pytest.raises(ServingError, match=r"(?s)did not become healthy.*compiling forever"):
        with server:
            pass
    assert server.proc is not None and server.proc.poll() is not None
    assert server.alive_pids() == []


def test_launched_server_serves_and_is_stopped_by_pid(tmp_path):
    server = VLLMServer(tmp_path, served_name="fake-m", python=sys.executable,
                        module="_fake_vllm", env={"PYTHONPATH": str(TESTS)},
                        log_path=tmp_path / "server.log", startup_timeout=60)
    with server:
        assert Client(server.url).models() == ["fake-m"]
        assert server.pid in server.alive_pids()
    assert server.alive_pids() == []
    assert not Client(server.url, timeout=2).healthy()


def test_launched_server_with_wrong_model_name(tmp_path):
    server = VLLMServer(tmp_path, served_name="wanted", python=sys.executable,
                        module="_fake_vllm", env={"PYTHONPATH": str(TESTS)},
                        log_path=tmp_path / "server.log", startup_timeout=60,
                        extra_args=["--served-model-name", "other"])
    with pytest.raises(ServingError, match=r"serves \['other'\], not 'wanted'"):
        with server:
            pass
    assert server.alive_pids() == []


# ---------------------------------------------------------------- whole benchmark (fake server)


def test_benchmark_on_fake_server(fake_server, tmp_path):
    url, state = fake_server
    state.spt = 1e-4  # computing tokens costs clearly more than the client's own overhead
    config = ErratumBenchConfig(context_tokens=(300, 600), sessions=2, edits=3, concurrency=(1, 2),
                         field_depth=0.1)
    result = _bench(Client(url), config)
    rows = {(s["context_tokens"], s["concurrency"], s["policy"]): s for s in result["summaries"]}
    assert len(rows) == 2 * 2 * 3
    for (_ctx, _conc, policy), s in rows.items():
        assert s["ok"] == s["requests"] == 2 * 3 and s["failed"] == 0
        assert s["ttft_p50_s"] <= s["ttft_p90_s"] <= s["ttft_p99_s"]
        if policy == "erratum":
            # short contexts: the appended errata + question are a fifth of the prompt
            assert s["hit_rate"] > 0.7
            assert s["hit_rate"] > rows[(_ctx, _conc, "in-place")]["hit_rate"] + 0.4
            assert s["hit_rate_usage"] == pytest.approx(s["hit_rate"])
            assert s["agreement_with_in_place"] == 1.0 and s["agreement_n"] == 6
        elif policy == "in-place":
            assert s["hit_rate"] < 0.3  # only the prefix before the field
        else:
            assert s["hit_rate"] == 0.0  # cache_salt per request
        assert s["accuracy"] == 1.0  # the fake answers from the last status it reads
    # every measured request went through; warm-ups too (2 cache-using policies x sessions)
    expected_requests = sum(2 * 3 * 3 + 2 * 2 for _ in range(4))
    assert state.queries > 0 and len(sum(state.prompts.values(), [])) == expected_requests
    for s in rows.values():  # where the time went, from the fake's per-request histograms
        b = s["breakdown"]
        assert b["n"] == 6 and b["queue_s"] >= 0 and b["compute_s"] > 0
        assert b["first_step_s"] == pytest.approx(state.step_s)
        assert b["client_ttft_s"] == pytest.approx(s["ttft_mean_s"])
        assert b["server_ttft_s"] <= b["client_ttft_s"]
        assert len(s["load_before"]) == len(s["load_after"]) == 3
        assert s["errors"] == {} and s["warmup_errors"] == {} and s["metrics_error"] is None
    # the erratum computes only its appended tail; in-place everything after the field
    for ctx in (300, 600):
        e, i = rows[(ctx, 1, "erratum")]["breakdown"], rows[(ctx, 1, "in-place")]["breakdown"]
        assert e["computed_tokens"] < i["computed_tokens"]
    assert result["server"]["block_size"] == 128  # from vllm:cache_config_info
    assert result["machine"]["cpus"] >= 1 and "cpu_flags" in result["machine"]
    assert result["errors"] == {} and result["contexts"] == [300, 600]
    paths = write_outputs(result, tmp_path / "out")
    data = json.loads(paths["json"].read_text())
    ratio = {(r["context_tokens"], r["concurrency"]): r for r in data["ratios"]}
    # the ratio is the report's arithmetic over its rows; how large it is belongs to the
    # benchmark's run, not to a test on a shared machine
    p90 = {pol: rows[(600, 1, pol)]["ttft_p90_s"] for pol in ("in-place", "erratum")}
    assert data["summaries"] and ratio[(600, 1)]["in-place_over_erratum_p90"] == pytest.approx(
        p90["in-place"] / p90["erratum"], rel=1e-3)
    report = paths["report"].read_text()
    assert "| 600 | 2 | erratum |" in report and "ttft_cdf.png" in report
    assert "KV block size 128 tokens" in report and "## Where the time to first token goes" in report
    assert paths["plot"].stat().st_size > 1000


def test_status_question_shows_whether_the_edit_was_read(fake_server):
    """--question status asks for the field's value itself; accuracy counts the new value and
    'old answer' the original one, so a reader that misses the appended corrections shows up."""
    url, state = fake_server
    s = _session(edits=3, question="status")
    assert s.question.startswith("Question: what is the current status of order #")
    assert s.expected(1) == s.turns[1].new and s.stale == s.initial
    assert s.answers[:2] == ("delivered to a locker", "returned unopened")  # longest first
    assert parse_answer("The status is delivered late.", s.answers) == "delivered late"
    with pytest.raises(UnknownNameError, match="unknown question 'mood'; valid questions: "
                                               "decision, status"):
        _session(question="mood")
    with pytest.raises(UnknownNameError, match="unknown question"):
        ErratumBenchConfig(question="mood")
    config = ErratumBenchConfig(context_tokens=(300,), sessions=2, edits=3, concurrency=(1,),
                         policies=("in-place", "erratum"), question="status")
    for reader, erratum_acc, erratum_old in (("last", 1.0, 0.0), ("none", 0.0, 1.0)):
        state.errata_reader = reader
        try:
            result = _bench(Client(url), config)
        finally:
            state.errata_reader = "last"
        rows = {r["policy"]: r for r in result["summaries"]}
        assert rows["in-place"]["accuracy"] == 1.0 and rows["in-place"]["stale_rate"] == 0.0
        assert rows["erratum"]["accuracy"] == erratum_acc
        assert rows["erratum"]["stale_rate"] == erratum_old
        assert sum(rows["erratum"]["decisions"].values()) == 6
    assert result["config"]["question"] == "status"
    assert "the order's current status" in report_markdown(result)


def test_latest_errata_form_writes_one_correction_from_the_context_value():
    """--errata latest: one correction from the value the context states to the current one,
    after the same byte-identical context, so a reader that takes the first correction it
    finds (as SmolLM2 did with appended errata) reads the current value."""
    s = _session(edits=3, errata="latest")
    for k, turn in enumerate(s.turns):
        erratum = s.prompt("erratum", k)
        assert erratum == (f"{s.context()}\n\n"
                           f"{erratum_text(s.field_label, s.initial, turn.new)}\n\n{s.question}")
        assert erratum.count("Correction:") == 1
    assert _session().errata == ErratumBenchConfig().errata == "follow-up-latest"  # the default
    appended = _session(edits=3, errata="append")
    assert appended.prompt("erratum", 2).count("Correction:") == 3
    follow = _session(edits=3, errata="follow-up")
    for k, turn in enumerate(follow.turns):
        erratum = follow.prompt("erratum", k)
        # the question asked once, first; each request is the previous one plus a correction
        previous = follow.prompt("erratum", k - 1) if k else follow.warmup_prompt()
        assert erratum.startswith(previous + "\n\n")
        assert erratum.endswith(f"{erratum_text(follow.field_label, turn.old, turn.new)} {REASK}")
        assert erratum.count(follow.question) == 1 and erratum.count("Correction:") == k + 1
    latest = _session(edits=3, errata="follow-up-latest")
    for k, turn in enumerate(latest.turns):  # the first request, then one correction
        assert latest.prompt("erratum", k) == (
            f"{latest.warmup_prompt()}\n\n"
            f"{erratum_text(latest.field_label, latest.initial, turn.new)} {REASK}")
    with pytest.raises(UnknownNameError, match="unknown errata form 'merge'; valid errata forms:"):
        _session(errata="merge")
    with pytest.raises(UnknownNameError, match="unknown errata form"):
        ErratumBenchConfig(errata="merge")


def test_first_correction_reader_misses_appended_edits_not_latest(fake_server):
    """A reader that repeats the first correction gets only the first edit right when errata are
    appended (before or after the question), and every edit with one latest correction; the
    report names the form."""
    url, state = fake_server
    acc = {}
    state.errata_reader = "first"
    try:
        for form in ("append", "latest", "follow-up", "follow-up-latest"):
            config = ErratumBenchConfig(context_tokens=(300,), sessions=2, edits=3, concurrency=(1,),
                                 policies=("erratum",), question="status", errata=form)
            result = _bench(Client(url), config)
            acc[form] = result["summaries"][0]["accuracy"]
            assert result["config"]["errata"] == form
    finally:
        state.errata_reader = "last"
    assert acc == {"append": pytest.approx(1 / 3), "latest": 1.0,
                   "follow-up": pytest.approx(1 / 3), "follow-up-latest": 1.0}
    for form, said in (("follow-up", "after the question, one correction per edit"),
                       ("follow-up-latest", "after the question, one correction from")):
        follow = ErratumBenchConfig(context_tokens=(300,), sessions=2, edits=3, concurrency=(1,),
                             policies=("erratum",), question="status", errata=form)
        result = _bench(Client(url), follow)
        assert result["summaries"][0]["accuracy"] == 1.0  # a reader of the last correction
        assert said in report_markdown(result)


def _small(**kw):
    args = dict(context_tokens=(200,), sessions=1, edits=2, concurrency=(1,),
                policies=("erratum",))
    return ErratumBenchConfig(**{**args, **kw})


@pytest.mark.parametrize("conc", [1, 4])
def test_async_concurrency_is_honoured(fake_server, conc):
    url, state = fake_server
    state.min_delay = 0.05  # long enough for the streams to overlap
    result = _bench(Client(url), _small(sessions=4, concurrency=(conc,)))
    (row,) = result["summaries"]
    assert row["ok"] == row["requests"] == 8
    assert state.max_inflight == conc  # never more in flight than asked, and exactly that many
    if conc > 1:  # the fake computes one request at a time: the others queue
        assert row["breakdown"]["queue_s"] > 0.01
    for s in result["sessions"]:  # each session's edits went in order (errata append-only)
        turns = [r["turn"] for r in result["requests"] if r["session"] == s["session"]]
        assert turns == [0, 1]


def test_bench_uses_async_openai_not_threads():
    import inspect

    import kvnotes_bench.serving.client as client
    import kvnotes_bench.serving.erratum as bench

    src = inspect.getsource(bench) + inspect.getsource(client)
    for gone in ("threading", "http.client", "queue.Queue"):
        assert gone not in src
    assert "AsyncOpenAI" in src and "asyncio" in src


def test_server_errors_counted_per_phase(fake_server, tmp_path):
    url, state = fake_server
    erratum = lambda p: "Correction:" in p  # noqa: E731
    state.fail("http_500", 1, when=lambda p: "Correction:" not in p)  # the first warm-up
    for kind in ("http_500", "http_500", "http_400", "drop", "cut", "stream_error", "hang"):
        state.fail(kind, 1, when=erratum)
    state.hang_s = 4.0
    config = _small(sessions=3, edits=3, policies=("in-place", "erratum", "cold"),
                    request_timeout_s=2.0)
    result = _bench(Client(url), config)  # nothing raised
    rows = {s["policy"]: s for s in result["summaries"]}
    assert rows["erratum"]["errors"] == {"connection": 2, "http_4xx": 1, "http_5xx": 2,
                                         "stream": 1, "timeout": 1}
    assert rows["erratum"]["failed"] == 7 and rows["erratum"]["ok"] == 2
    assert rows["in-place"]["warmup_errors"] == {"http_5xx": 1}
    assert rows["in-place"]["errors"] == {} and rows["in-place"]["ok"] == 9
    assert rows["cold"]["errors"] == {} and rows["cold"]["ok"] == 9
    assert result["errors"] == {"connection": 2, "http_4xx": 1, "http_5xx": 3, "stream": 1,
                                "timeout": 1}
    failed = [r for r in result["requests"] if not r["ok"]]
    assert {r["error_kind"] for r in failed} == {"connection", "http_4xx", "http_5xx", "stream",
                                                 "timeout"}
    assert all(r["error"] for r in failed)
    assert rows["erratum"]["breakdown"]["n"] < 9  # only requests that reached the engine
    report = write_outputs(result, tmp_path)["report"].read_text()
    assert "connection 2, http_4xx 1, http_5xx 2, stream 1, timeout 1" in report
    assert "warm-ups failed 1" in report


def test_server_gone_mid_run_is_counted_not_raised(fake_server, monkeypatch):
    import kvnotes_bench.serving.client as client_module
    import kvnotes_bench.serving.erratum as erratum

    url, state = fake_server
    gone = f"http://127.0.0.1:{_closed_port()}"
    # the server answers the set-up calls, then is gone for the requests
    monkeypatch.setattr(erratum, "open_client",
                        lambda _url, *, timeout: client_module.open_client(gone, timeout=timeout))
    result = _bench(Client(url), _small())
    (row,) = result["summaries"]
    assert row["ok"] == 0 and row["errors"] == {"connection": 2}
    assert row["warmup_errors"] == {"connection": 1}


@pytest.mark.parametrize("bad", [0, -32, 48, 100, True, 64.0])
def test_block_size_validated(bad):
    msg = (f"--block-size must be a positive multiple of 32 (vLLM's CPU backend), got {bad!r}: "
           "try 32, 64 or 128")
    with pytest.raises(InvalidArgumentError) as err:
        ErratumBenchConfig(block_size=bad)
    assert str(err.value) == msg
    assert validate_block_size(64) == 64 and validate_block_size(None) is None


def test_block_size_recorded_from_server_metrics(tmp_path):
    httpd, _ = _fake_vllm.serve(0, "smollm2-135m", block_size=64)
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        result = _bench(Client(url), _small(edits=1))
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert result["server"]["block_size"] == 64
    assert result["server"]["cache_config"]["block_size"] == "64"
    assert "KV block size 64 tokens" in write_outputs(result, tmp_path)["report"].read_text()


def test_launch_passes_and_records_block_size(tmp_path, fake_launch):
    from typer.testing import CliRunner

    from kvnotes_bench.cli import app

    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["serve", "erratum", "--launch", "--block-size", "64",
                                   "--dtype", "float32", "--context-tokens", "200", "--sessions",
                                   "1", "--edits", "1", "--concurrency", "1", "--policies",
                                   "erratum", "--out", str(out)])
    assert res.exit_code == 0, res.output
    # the context length fitted to the longest prompt, at least 4096
    assert fake_launch == [{"extra_args": ["--block-size", "64"], "dtype": "float32",
                            "max_model_len": 4096}]
    data = json.loads((out / "result.json").read_text())
    assert data["server"]["block_size"] == 64 and data["launch"]["block_size"] == 64
    assert data["config"]["block_size"] == 64 and data["launch"]["stopped"]
    assert data["launch"]["max_model_len"] == 4096 and not data["launch"]["connector"]
    assert "KV block size 64 tokens" in (out / "report.md").read_text()
    assert (out / "server.log").is_file()


def test_cli_block_size_errors():
    from typer.testing import CliRunner

    from kvnotes_bench.cli import app

    res = CliRunner().invoke(app, ["serve", "erratum", "--launch", "--block-size", "48"])
    assert res.exit_code == 2 and "multiple of 32" in res.output
    res = CliRunner().invoke(app, ["serve", "erratum", "--url", "http://127.0.0.1:1",
                                   "--block-size", "64"])
    assert res.exit_code == 2 and "read from its /metrics" in res.output


def test_loopback_guard_before_any_client(monkeypatch):
    import httpx2
    import openai
    from typer.testing import CliRunner

    from kvnotes_bench.cli import app

    made = []

    def record(name):
        def init(self, *a, **kw):
            made.append(name)
            raise AssertionError(f"{name} made for a non-loopback server")
        return init

    monkeypatch.setattr(openai.AsyncOpenAI, "__init__", record("AsyncOpenAI"))
    monkeypatch.setattr(openai.OpenAI, "__init__", record("OpenAI"))
    monkeypatch.setattr(httpx2.Client, "__init__", record("httpx2.Client"))
    monkeypatch.setattr(httpx2.AsyncClient, "__init__", record("httpx2.AsyncClient"))
    with pytest.raises(ServingError, match="only loopback servers"):
        Client("http://10.1.2.3:8000")
    res = CliRunner().invoke(app, ["serve", "erratum", "--url", "http://10.1.2.3:8000",
                                   "--context-tokens", "100", "--concurrency", "1"])
    assert res.exit_code == 1 and "only loopback servers are allowed" in res.output
    assert made == []


def test_matrix_preset():
    m = matrix_config()
    assert m.context_tokens == (1000, 4000, 8000) and m.optional_contexts == (16000,)
    assert m.concurrency == (1, 4, 16) and m.policies == ("in-place", "erratum", "cold")
    assert m.requests_per_row == 16
    assert [m.sessions_for(c) * m.edits for c in (1, 4, 16)] == [16, 16, 64]
    assert matrix_config(edits=1).sessions_for(1) == 16
    with pytest.raises(InvalidArgumentError, match="requests-per-row"):
        ErratumBenchConfig(requests_per_row=-1)


def test_optional_context_runs_only_when_the_model_allows(fake_server):
    url, state = fake_server
    state.max_model_len = 700
    config = _small(edits=1, optional_contexts=(400, 5000), requests_per_row=3)
    result = _bench(Client(url), config)
    assert result["contexts"] == [200, 400]
    assert result["contexts_skipped"] == [{"context_tokens": 5000,
                                           "reason": "the server's max model length is 700 "
                                                     "tokens"}]
    assert [s["requests"] for s in result["summaries"]] == [3, 3]  # requests per row honoured


def test_cli_matrix_on_fake_server(fake_server, tmp_path):
    from typer.testing import CliRunner

    from kvnotes_bench.cli import app

    url, state = fake_server
    state.spt = 0.0
    out = tmp_path / "m"
    res = CliRunner().invoke(app, ["serve", "erratum", "--url", url, "--matrix", "--context-tokens",
                                   "150", "--concurrency", "4", "--policies", "erratum",
                                   "--edits", "1", "--out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "result.json").read_text())
    assert data["config"]["requests_per_row"] == 16 and data["config"]["optional_contexts"] == []
    assert data["summaries"][0]["requests"] == 16 and data["summaries"][0]["ok"] == 16
    assert data["config"]["question"] == "decision" and data["config"]["max_tokens"] == 8
    # --question status: room for a restated question before the status, unless told
    for extra, tokens in (([], 24), (["--max-tokens", "5", "--errata", "append"], 5)):
        res = CliRunner().invoke(app, ["serve", "erratum", "--url", url, "--context-tokens", "150",
                                       "--concurrency", "1", "--policies", "erratum", "--edits",
                                       "1", "--sessions", "1", "--question", "status",
                                       "--out", str(out), *extra])
        assert res.exit_code == 0, res.output
        data = json.loads((out / "result.json").read_text())
        assert data["config"]["question"] == "status" and data["config"]["max_tokens"] == tokens
        assert data["config"]["errata"] == ("append" if extra else "follow-up-latest")
        assert data["summaries"][0]["accuracy"] == 1.0
    res = CliRunner().invoke(app, ["serve", "erratum", "--url", url, "--question", "mood"])
    assert res.exit_code == 2 and "unknown question 'mood'" in res.output
    res = CliRunner().invoke(app, ["serve", "erratum", "--url", url, "--errata", "merge"])
    assert res.exit_code == 2 and "unknown errata form 'merge'" in res.output
    res = CliRunner().invoke(app, ["serve", "erratum", "--url", url, "--max-tokens", "0"])
    assert res.exit_code == 2 and "--max-tokens must be at least 1, got 0" in res.output


def test_time_budget_skips_requests(fake_server):
    url, _ = fake_server
    config = ErratumBenchConfig(context_tokens=(200,), sessions=1, edits=2, concurrency=(1,),
                         time_budget_s=0.0)
    result = _bench(Client(url), config)
    assert all(s["ok"] == 0 and s["skipped"] == s["requests"] for s in result["summaries"])


def test_cli_rejects_url_and_launch_together():
    from typer.testing import CliRunner

    from kvnotes_bench.cli import app

    res = CliRunner().invoke(app, ["serve", "erratum", "--url", "http://127.0.0.1:1", "--launch"])
    assert res.exit_code != 0
    res = CliRunner().invoke(app, ["serve", "erratum", "--url", f"http://127.0.0.1:{_closed_port()}",
                                   "--context-tokens", "100", "--sessions", "1", "--edits", "1",
                                   "--concurrency", "1"])
    # a server that cannot be reached is a runtime failure (exit 1), not a usage error (2)
    assert res.exit_code == 1 and "cannot reach the server" in res.output


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_stops_the_launched_server(tmp_path, sig):
    import os
    import signal
    import subprocess
    import time

    script = tmp_path / "run.py"
    # the Ctrl-C of an interactive terminal: a test run started in the background ('make test &')
    # inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler
    script.write_text(textwrap.dedent(f"""\
        import signal, sys, time
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from kvnotes.serving.launch.process import VLLMServer
        server = VLLMServer({str(tmp_path)!r}, served_name="fake-m", python=sys.executable,
                            module="_fake_vllm", env={{"PYTHONPATH": {str(TESTS)!r}}},
                            log_path={str(tmp_path / "server.log")!r}, startup_timeout=60)
        with server:
            print("SERVER", server.pid, flush=True)
            time.sleep(120)
        """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("SERVER"), line
        server_pid = int(line.split()[1])
        os.kill(server_pid, 0)  # running
        proc.send_signal(getattr(signal, sig))
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{server_pid}").exists():
        time.sleep(0.2)
    assert not Path(f"/proc/{server_pid}").exists(), "the server outlived Ctrl-C / SIGTERM"
