"""The skills workload of serve-bench without vLLM: prompts, summaries, report, and a whole run
against the fake OpenAI-compatible server."""

from __future__ import annotations

import pytest

from kvnotes.apps.agent.prompt import HEADER
from kvnotes.core.errors import InvalidArgumentError, UnknownNameError
from kvnotes.core.repair import Repair
from kvnotes.serving.compose_client import ComposeClient, ComposeResult
from kvnotes.serving.planning.layout import prompt_ids
from kvnotes.serving.protocol import UsageKvnotes, WirePlan
from kvnotes_bench.kit.machine import MachineRecord
from kvnotes_bench.serving.kit import PhaseSummary
from kvnotes_bench.serving.prompt_sets import (
    AirlinePrompts,
    bfcl_prompts,
    call_name,
    library_index,
    make_prompt_set,
    make_requests,
    skill_texts,
)
from kvnotes_bench.serving.skills import SkillsResult, run_skills_benchmark
from kvnotes_bench.serving.skills_clients import FrontClients, make_clients
from kvnotes_bench.serving.skills_config import SkillsBenchConfig
from kvnotes_bench.serving.skills_fidelity import Fidelity, HalfCounts, measure_fidelity
from kvnotes_bench.serving.skills_report import fidelity_lines, markdown, report, write_outputs


def test_requests_pick_k_distinct_skills_in_random_order():
    reqs = make_requests(30, 4, seed=1)
    skills = set(skill_texts().values())
    assert len(skills) >= 8
    orders = set()
    for parts in reqs:
        assert parts[0] == HEADER and len(parts) == 6
        chosen = parts[1:5]
        assert len(set(chosen)) == 4 and set(chosen) <= skills
        assert "Customer" in parts[5]
        orders.add(tuple(chosen))
    assert len(orders) > 25  # orders rarely repeat: prefix caching gets little
    assert make_requests(30, 4, seed=1) == reqs  # deterministic per seed


def test_skills_are_realistic_lengths(tokenizer):
    for name, text in skill_texts().items():
        n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert 200 <= n <= 600, (name, n)


def test_prompt_ids_are_per_part_tokenization(tokenizer):
    parts = ["Header.\n", "Skill one.", " User asks?"]
    ids = prompt_ids(tokenizer, parts)
    expected = [t for p in parts for t in tokenizer(p, add_special_tokens=False)["input_ids"]]
    assert ids == expected  # SmolLM2 adds no BOS
    with pytest.raises(TypeError, match="list of strings"):
        prompt_ids(tokenizer, "one string")


def test_config_errors():
    with pytest.raises(UnknownNameError, match="valid policies: cold, prefix, compose, "
                                               "repaired, guarded"):
        SkillsBenchConfig(policies=("compose", "warm"))
    with pytest.raises(InvalidArgumentError, match="k must be between"):
        SkillsBenchConfig(k=0)
    with pytest.raises(InvalidArgumentError, match="margin >= 0"):
        SkillsBenchConfig(guard_tau=-1.0)
    with pytest.raises(InvalidArgumentError, match="calibration sample"):
        SkillsBenchConfig(calibration_samples=0)


def _summary(policy: str, conc: int, p90: float) -> PhaseSummary:
    return PhaseSummary(policy=policy, concurrency=conc, requests=4, ok=4, failed=0, skipped=0,
                        ttft_p50_s=p90 / 2, ttft_p90_s=p90, ttft_p99_s=p90, ttft_mean_s=p90 / 2,
                        hit_rate=None, hit_rate_usage=0.9 if policy == "compose" else 0.0,
                        queries_tokens=None, hits_tokens=None, requests_per_s=None, wall_s=1.0,
                        mean_prompt_tokens=1600.0)


def test_ratios_and_report():
    rows = [_summary("cold", 1, 6.0), _summary("prefix", 1, 5.0), _summary("compose", 1, 0.5)]
    result = SkillsResult(config=SkillsBenchConfig(concurrency=(1,)),
                          machine=MachineRecord(2, "cpu", [], [0.1, 0.2, 0.3], [0.4, 0.5, 0.6]),
                          server=None, phases=rows, requests=[],
                          fidelity=[Fidelity(samples=2, failed=0, first_token_agreement=1.0,
                                             continuation_identity=0.5, continuation_tokens=16,
                                             top20_overlap_mean=0.9, cases=[]),
                                    Fidelity(samples=2, failed=0, first_token_agreement=1.0,
                                             continuation_identity=1.0, continuation_tokens=16,
                                             top20_overlap_mean=1.0, cases=[],
                                             policy="guarded", guard_fires=1)])
    data = result.to_dict()
    assert data["ratios"] == [{"concurrency": 1, "prefix_over_compose_p90": 10.0,
                               "cold_over_compose_p90": 12.0}]
    assert "context_tokens" not in data["summaries"][0]  # the skills rows do not vary it
    md = markdown(data)
    assert md == report(result) == report(SkillsResult.from_dict(data))
    assert "| compose | 1 | 4/4 |" in md and "prefix / compose = 10.0x" in md
    assert "| compose | 100.0% | 50.0% | 90.0% | - |" in md
    assert "| guarded | 100.0% | 100.0% | 100.0% | 1 |" in md
    assert "0.1/0.2/0.3 / 0.4/0.5/0.6" in md


def test_skills_benchmark_on_fake_server(fake_server, tokenizer, tmp_path):
    """The whole workload on the shared kit: every phase measured, its /metrics read, the
    concurrency honoured; the fake reuses only exact prefixes within one salt."""
    url, state = fake_server
    state.min_delay = 0.02
    config = SkillsBenchConfig(requests=4, concurrency=(1, 2), fidelity_samples=2, warmup=1,
                               calibration_samples=2)
    client = ComposeClient(url, "smollm2-135m", tokenizer)
    data = run_skills_benchmark(client, config, log=lambda s: None).to_dict()
    rows = {(s["policy"], s["concurrency"]): s for s in data["summaries"]}
    assert set(rows) == {(p, c) for p in ("cold", "prefix", "compose", "repaired", "guarded")
                         for c in (1, 2)}
    # three skills after the first are repaired (a phase each, 128-token blocks); the fake
    # sends no logprobs, so the guard cannot see a margin and always answers exactly
    phased = {(r["policy"], r["concurrency"]): r for r in data["phased"]}
    assert phased[("repaired", 1)]["phases_per_request"] == 3.0
    assert phased[("guarded", 2)]["guard_fires"] == 4
    assert phased[("repaired", 2)]["guard_fires"] is None
    assert data["guard_tau"] == 0.5 and data["calibration"]["cases"] == []
    assert [f["policy"] for f in data["fidelity"]] == ["compose", "repaired", "guarded"]
    # server-side requests per measured one: 3 phases + the real one (+ the exact answer)
    per_request = {"repaired": 4, "guarded": 5}
    for (policy, _), s in rows.items():
        assert s["ok"] == s["requests"] == 4 and s["failed"] == 0 and s["errors"] == {}
        assert s["breakdown"]["n"] == 4 * per_request.get(policy, 1)
        assert s["metrics_error"] is None
        assert s["mean_prompt_tokens"] > 1000
    assert rows[("cold", 1)]["hit_rate_usage"] == 0.0
    assert state.max_inflight == 2
    assert [r["concurrency"] for r in data["ratios"]] == [1, 2]
    assert data["fidelity"][0]["samples"] == 2 and data["server"]["block_size"] == 128
    assert data["machine"]["load_average_end"] is not None
    paths = write_outputs(data, tmp_path)
    assert "| compose | 2 | 4/4 |" in paths["report"].read_text()
    assert "`Repair(first=32)` aligned" in paths["report"].read_text()
    data["config"]["repair"] = 96
    assert "`Repair(first=96)` aligned" in markdown(data)
    assert data["started"][:2] == "20" and data["finished"] >= data["started"]
    data["command"] = "kvnotes-bench serve skills --launch"
    assert (f"Run {data['started']} to {data['finished']} UTC: `kvnotes-bench serve skills "
            "--launch`.") in markdown(data)
    phased_clients = make_clients(client, ("repaired",), 128, repair_tokens=96)
    assert phased_clients.repair == Repair(first=96) and phased_clients.repaired is not None


def test_cli_skills_options_checked_before_any_server():
    from typer.testing import CliRunner

    from kvnotes_bench.cli import app

    res = CliRunner().invoke(app, ["serve", "skills", "--url", "http://127.0.0.1:1"])
    assert res.exit_code == 2 and "--url needs --skills DIR" in res.output
    res = CliRunner().invoke(app, ["serve", "skills", "--launch", "--k", "0"])
    assert res.exit_code == 2 and "--k must be between 1 and" in res.output
    res = CliRunner().invoke(app, ["serve", "skills", "--launch", "--policies", "warm"])
    assert res.exit_code == 2 and "unknown policy 'warm'" in res.output
    res = CliRunner().invoke(app, ["serve", "skills", "--launch", "--guard-tau", "-1"])
    assert res.exit_code == 2 and "margin >= 0" in res.output
    res = CliRunner().invoke(app, ["serve", "--workload", "skills"])
    assert res.exit_code == 2  # one subcommand per workload


def test_reused_fraction():
    assert ComposeResult(ok=True, prompt_tokens=200, cached_tokens=150).reused_fraction == 0.75
    assert ComposeResult(ok=False).reused_fraction is None


def test_library_index_places_pieces_where_register_skills_compiles_them(tokenizer):
    idx = library_index(tokenizer)
    header = idx.get("header")
    assert header is not None and header.origin == 0  # SmolLM2 adds no BOS
    for name in skill_texts():
        piece = idx.get(name)
        assert piece is not None and piece.origin == len(header)  # compiled behind the header
    alone = library_index(tokenizer, anchor=False)
    assert {alone.get(n).origin for n in skill_texts()} == {0}  # type: ignore[union-attr]


def test_bfcl_prompts_are_the_tools_bench_cases_in_its_halves(tokenizer):
    from kvnotes_bench.tools.data import load_cases, spread
    from kvnotes_bench.tools.prompt import CALL_OPENING, case_prompt

    ps = bfcl_prompts(tokenizer, cases=12, max_context=2048)
    picked = spread(load_cases("live_multiple"), 12)
    assert len(ps.cases) + len(ps.skipped) == 12
    by_id = {c.id: c for c in picked}
    for i, case in enumerate(ps.cases):
        prompt = case_prompt(tokenizer, by_id[case.id])
        assert case.parts == (prompt.header, *prompt.skills, prompt.question + prompt.query)
        assert case.parts[-1].endswith(CALL_OPENING) and case.tokens <= 2048 - 16
        assert case.half == ("calibrate" if picked.index(by_id[case.id]) % 2 == 0
                             else "evaluate")
        assert set(case.parts[1:-1]) <= set(ps.skills.values())  # every function published
        assert ps.info(list(case.parts)) == {"case": case.id, "half": case.half,
                                             "answers": list(case.answers)}
        del i
    calib = ps.requests(100, 0, "calibration")
    assert {ps.info(p)["half"] for p in calib} == {"calibrate"}
    fid = ps.requests(100, 0, "fidelity")
    assert len(fid) == len(ps.cases)  # every case once, calibration half first
    assert [ps.info(p)["half"] for p in fid] == sorted(ps.info(p)["half"] for p in fid)
    ttft = ps.requests(30, 3, "ttft")
    assert len(ttft) == 30 and ps.requests(30, 3, "ttft") == ttft
    assert ps.info(["not", "a case"]) == {}
    idx = ps.index(tokenizer, anchor=True)
    header = idx.get("header")
    assert header is not None
    assert {idx.get(n).origin for n in ps.skills} == {len(header)}  # type: ignore[union-attr]
    tiny = bfcl_prompts(tokenizer, cases=12, max_context=300)
    assert len(tiny.cases) < len(ps.cases) and tiny.skipped
    with pytest.raises(InvalidArgumentError, match="--cases"):
        bfcl_prompts(tokenizer, cases=0)
    with pytest.raises(UnknownNameError, match="prompt purpose"):
        ps.requests(1, 0, "tuning")


def test_bfcl_multi_turn_prompts_make_each_class_manual_a_skill(tokenizer):
    from kvnotes_bench.tools.data import load_cases, spread

    ps = bfcl_prompts(tokenizer, cases=4, max_context=8192, name="bfcl-multi_turn")
    assert ps.name == "bfcl-multi_turn" and ps.set_name == "multi_turn" and ps.decides
    picked = {c.id: c for c in spread(load_cases("multi_turn"), 4)}
    assert len(ps.cases) + len(ps.skipped) == 4 and ps.cases
    for case in ps.cases:
        classes = picked[case.id].meta["involved_classes"]
        assert len(case.parts) == 2 + len(classes)  # header, one manual per class, question
        assert set(case.parts[1:-1]) <= set(ps.skills.values())
        assert case.tokens > 1000  # manuals are long skills
    assert all(n.startswith("api-") for n in ps.skills)
    assert "API manual" in ps.describe() and "multi_turn" in ps.describe()
    assert make_prompt_set("bfcl-multi_turn", tokenizer, cases=2, max_context=8192).name == \
        "bfcl-multi_turn"
    with pytest.raises(UnknownNameError, match="BFCL prompt set"):
        bfcl_prompts(tokenizer, name="bfcl-simple")


def test_call_name_reads_the_name_up_to_its_quote():
    assert call_name('get_weather", "arguments": {}}') == "get_weather"
    assert call_name("get_wea") is None  # never closed within the answer
    assert call_name('"') == ""


def test_prompt_set_names_and_airline_checks(tokenizer):
    assert isinstance(make_prompt_set("airline", tokenizer, k=3), AirlinePrompts)
    with pytest.raises(UnknownNameError, match="valid prompt sets: airline, bfcl, bfcl-multi_turn"):
        make_prompt_set("alpaca", tokenizer)
    with pytest.raises(InvalidArgumentError, match="k must be between"):
        AirlinePrompts(0)
    with pytest.raises(UnknownNameError, match="--via"):
        SkillsBenchConfig(via="proxy")
    with pytest.raises(UnknownNameError, match="prompt set"):
        SkillsBenchConfig(prompts="alpaca")
    assert AirlinePrompts(2).decision("anything") is None


class _Scripted:
    """Answers by policy and prompt from a table: a stand-in for the benchmark's clients."""

    def __init__(self, answers, exact):
        self.answers, self.tau = answers, None
        outer = self

        class Plain:
            def complete(self, parts, **kw):
                assert kw["splice"] is False
                return outer._result(exact[parts[-1]])

        self.plain = Plain()

    @staticmethod
    def _result(text):
        return ComposeResult(ok=True, text=text, tokens=[text[:2]], prompt_tokens=10,
                             cached_tokens=5, top_logprobs=[{text[:2]: -0.1, "zz": -2.0}])

    def send(self, policy, parts, max_tokens, *, logprobs=None):
        res = self._result(self.answers[policy][parts[-1]])
        res.guard_fired = True if policy == "guarded" and parts[-1] == "q2" else (
            False if policy == "guarded" else None)
        return res


def test_fidelity_reads_decisions_and_right_tools(tokenizer):
    from kvnotes_bench.serving.prompt_sets import BfclCase, BfclPrompts

    ps = BfclPrompts(cases=[BfclCase("c1", ("h", "s", "q1"), "calibrate", ("alpha",), 9),
                            BfclCase("c2", ("h", "s", "q2"), "evaluate", ("beta",), 9)],
                     header="h", skills={"fn-a": "s"})
    exact = {"q1": 'alpha", "arguments"', "q2": 'beta", "x'}
    answers = {"compose": {"q1": 'alpha", "other', "q2": 'gamma", "x'},
               "guarded": {"q1": 'alpha", "arguments"', "q2": 'beta", "x'}}
    clients = _Scripted(answers, exact)
    comp, guarded = measure_fidelity(clients, [["h", "s", "q1"], ["h", "s", "q2"]], 16,
                                     ("compose", "guarded"), prompt_set=ps)
    assert comp.decision_identity == 0.5 and comp.continuation_identity == 0.0
    assert (comp.right_exact, comp.right_spliced) == (2, 1)
    assert comp.halves == {"calibrate": HalfCounts(n=1, decision_identical=1, first_token_agree=1),
                           "evaluate": HalfCounts(n=1)}
    assert Fidelity.from_dict(comp.to_dict()) == comp  # the JSON form reads back typed
    assert guarded.decision_identity == 1.0 and guarded.guard_fires == 1
    assert comp.cases[1]["decision"] == "gamma" and comp.cases[1]["exact_decision"] == "beta"
    md = "\n".join(fidelity_lines([comp, guarded]))
    assert "| compose | 50.0% | 2/2 / 1/2 | 50.0% | 0.0% |" in md
    assert "| guarded | evaluate | 1 | 1 | 1 | 1 | 1 |" in md
    both = measure_fidelity(clients, [["h", "s", "q1"], ["h", "s", "q2"]], 16, ("compose",),
                            prompt_set=ps, concurrency=2)
    assert both[0].concurrency == 2 and both[0].decision_identity == 0.5  # the same answers
    md = "\n".join(fidelity_lines([comp, both[0]]))
    assert "| compose @ 1 |" in md and "| compose @ 2 |" in md
    # the airline set reads no decision: the columns stay out
    plain = measure_fidelity(clients, [["h", "s", "q1"]], 16, ("compose",),
                             prompt_set=AirlinePrompts())
    assert plain[0].decision_identity is None and plain[0].right_exact is None


def test_front_clients_send_text_with_the_policy_options(tokenizer):
    sent = []
    plan = WirePlan(10, 16, Repair(first=32, align=16), "salt", (), (), (), ("a",))

    class Front:
        model = "m"

        def send(self, body):
            sent.append(body)
            planned = body["kvnotes"].get("splice", True)
            return ComposeResult(
                ok=True, text="x", tokens=["x"], top_logprobs=[{"x": -0.5, "y": -1.75}],
                usage_kvnotes=(UsageKvnotes(300, 2, True, plan) if planned else None))

    fc = FrontClients(plain=None, front=Front(), tau=0.7)  # type: ignore[arg-type]
    assert fc.options("prefix") == {"splice": False}
    assert fc.options("compose") == {"tenant": "compose", "repair": 0, "guard": 0}
    assert fc.options("repaired") == {"tenant": "repaired", "repair": 32, "guard": 0}
    assert fc.options("guarded") == {"tenant": "guarded", "repair": 32, "guard": 0.7}
    res = fc.send("guarded", ["head", "skill", "question"], 4, logprobs=2)
    assert sent[-1]["prompt"] == "headskillquestion" and sent[-1]["logprobs"] == 2
    assert (res.phases, res.spliced_tokens, res.guard_fired) == (2, 300, True)
    assert res.margin == pytest.approx(1.25) and res.plan == plan
    res = fc.send("cold", ["head", "q"], 4)
    assert sent[-1]["cache_salt"].startswith("cold-") and sent[-1]["kvnotes"] == {"splice": False}
    assert res.phases == 0 and res.guard_fired is None  # forwarded: nothing planned
    with pytest.raises(UnknownNameError):
        fc.send("warm", ["q"], 1)
    longer = FrontClients(plain=None, front=Front(), repair=Repair(first=96))  # type: ignore[arg-type]
    assert longer.options("repaired") == {"tenant": "repaired", "repair": 96, "guard": 0}
    assert SkillsBenchConfig(repair=96).repair == 96
    for bad in (0, -32, True, 1.5):
        with pytest.raises(InvalidArgumentError, match="--repair"):
            SkillsBenchConfig(repair=bad)  # type: ignore[arg-type]
