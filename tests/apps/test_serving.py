"""serve-bench without vLLM: workload generator, /metrics parsing, client errors, server
lifecycle and the whole benchmark against a small fake OpenAI-compatible server."""

from __future__ import annotations

import json
import socket
import sys
import textwrap
from pathlib import Path

import pytest

from kvnotes.apps.serving import (
    BenchConfig,
    Client,
    PrefixCacheCounters,
    ServingError,
    VLLMServer,
    check_loopback_url,
    find_vllm_python,
    make_session,
    make_sessions,
    parse_prometheus,
    percentile,
    run_benchmark,
    write_outputs,
)
from kvnotes.apps.serving.metrics import agreement
from kvnotes.apps.serving.workload import ANSWERS, MAX_EDITS, REFUND_STATUSES, whitespace_tokens
from kvnotes.core.errors import UnknownNameError
from kvnotes.ops.decisions import parse_answer
from kvnotes.ops.edit import erratum_text

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
import _fake_vllm  # noqa: E402


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
    s = _session(edits=3)
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
process_open_fds 31.0
broken line without value
vllm:gpu_cache_usage_perc NaN
"""


def test_parse_prometheus_sums_label_sets():
    m = parse_prometheus(METRICS)
    assert m["vllm:prefix_cache_queries_total"] == 2000.0
    assert m["vllm:prefix_cache_hits_total"] == 900.0
    assert m["process_open_fds"] == 31.0
    assert m["vllm:prefix_cache_queries_created"] == pytest.approx(1.7959896e9)
    assert "broken" not in m


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
        run_benchmark(client, BenchConfig(context_tokens=(100,), sessions=1, edits=1,
                                          concurrency=(1,)), log=lambda s: None)


@pytest.fixture()
def fake_server():
    httpd, state = _fake_vllm.serve(0, "smollm2-135m")
    yield f"http://127.0.0.1:{httpd.server_address[1]}", state
    httpd.shutdown()
    httpd.server_close()


def test_model_not_served_lists_served_models(fake_server):
    url, _ = fake_server
    with pytest.raises(ServingError, match=r"does not serve 'other'.*smollm2-135m"):
        run_benchmark(Client(url), BenchConfig(model="other", context_tokens=(100,)),
                      log=lambda s: None)


def test_context_longer_than_the_server_allows(fake_server):
    url, state = fake_server
    state.max_model_len = 1024
    with pytest.raises(ServingError, match="max model length is 1024"):
        run_benchmark(Client(url), BenchConfig(context_tokens=(1000,)), log=lambda s: None)


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
    config = BenchConfig(context_tokens=(300, 600), sessions=2, edits=3, concurrency=(1, 2),
                         field_depth=0.1)
    result = run_benchmark(Client(url), config, log=lambda s: None)
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
    paths = write_outputs(result, tmp_path / "out")
    data = json.loads(paths["json"].read_text())
    assert data["summaries"] and data["ratios"][0]["in-place_over_erratum_p90"] > 1
    report = paths["report"].read_text()
    assert "| 600 | 2 | erratum |" in report and "ttft_cdf.png" in report
    assert paths["plot"].stat().st_size > 1000


def test_time_budget_skips_requests(fake_server):
    url, _ = fake_server
    config = BenchConfig(context_tokens=(200,), sessions=1, edits=2, concurrency=(1,),
                         time_budget_s=0.0)
    result = run_benchmark(Client(url), config, log=lambda s: None)
    assert all(s["ok"] == 0 and s["skipped"] == s["requests"] for s in result["summaries"])


def test_cli_rejects_url_and_launch_together():
    from typer.testing import CliRunner

    from kvnotes.cli import app

    res = CliRunner().invoke(app, ["serve-bench", "--url", "http://127.0.0.1:1", "--launch"])
    assert res.exit_code != 0
    res = CliRunner().invoke(app, ["serve-bench", "--url", f"http://127.0.0.1:{_closed_port()}",
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
    script.write_text(textwrap.dedent(f"""\
        import sys, time
        from kvnotes.apps.serving import VLLMServer
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
