"""``kvnotes-bench serve skills``: composed skills vs prefix caching vs cold inside vLLM.

Its options' defaults are :class:`~kvnotes_bench.serving.skills_config.SkillsBenchConfig`'s, read
from it; the server options are :class:`~kvnotes_bench.cli.serve_bench.ServerOptions`'.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from kvnotes.cli.app import folder_option
from kvnotes.cli.options import default_of
from kvnotes_bench.cli.app import invocation
from kvnotes_bench.cli.serve_bench import (
    AsJson,
    BlockSize,
    Dtype,
    KvCacheGib,
    Launch,
    Model,
    Out,
    RequestTimeout,
    ServerOptions,
    StartupTimeout,
    Url,
    VllmPython,
    Written,
    bench_app,
    int_list,
    name_list,
    print_result,
    say,
)
from kvnotes_bench.serving.skills_config import DEFAULT_POLICIES, SkillsBenchConfig


def _default(name: str) -> Any:
    """A default of :class:`SkillsBenchConfig`: the option's."""
    return default_of(SkillsBenchConfig, name)


K = Annotated[int, typer.Option("--k", help="Skills per request")]
Requests = Annotated[int, typer.Option("--requests", help="Requests per row")]
Concurrency = Annotated[str | None, typer.Option(
    "--concurrency", help="Concurrency levels, comma-separated (default "
    f"{','.join(map(str, _default('concurrency')))})")]
Policies = Annotated[str | None, typer.Option(
    "--policies", help="Policies, comma-separated, of cold, prefix, compose (bare splice), "
    "repaired (each skill's first --repair tokens computed by vLLM in phases, aligned to the "
    "block size), guarded (repaired, answered exactly when the first token is a close "
    "call), variants (repaired, each skill also compiled behind the header and the skill "
    "that precedes it in the run's requests; needs --via front), variants-guarded "
    "(variants with the guard: the front's default when its library holds variants; "
    "needs --via front); default all but the variants ones")]
FidelitySamples = Annotated[int, typer.Option(
    "--fidelity-samples", help="Prompts each spliced policy (compose, repaired, guarded, "
    "variants, variants-guarded) answers, checked against the exact prompt")]
GuardTau = Annotated[float | None, typer.Option(
    "--guard-tau", help="The guard's top-1 minus top-2 log-prob margin (default: chosen "
    "on --calibration-samples development prompts)")]
CalibrationSamples = Annotated[int, typer.Option(
    "--calibration-samples", help="Development prompts the guard's tau is chosen on")]
SkillsDir = Annotated[Path | None, typer.Option(
    "--skills", help="The server's skill folder (with --url: the one given to `kvnotes "
    "serve`; --launch default: OUT/skills)")]
NoAnchor = Annotated[bool, typer.Option(
    "--no-anchor", help="Compile each policy alone instead of behind the system header "
    "(for comparison)")]
Prompts = Annotated[str, typer.Option(
    "--prompts", help="What the requests are: airline (the agent's policies, --k per "
    "prompt, a customer's question), bfcl (BFCL live_multiple development cases: each "
    "function description a skill; the decision is the function name answered) or "
    "bfcl-multi_turn (BFCL multi_turn cases: each class's API manual a skill)")]
Cases = Annotated[int, typer.Option(
    "--cases", help="--prompts bfcl*: cases spread over the set (as `kvnotes-bench tools`)")]
MaxContext = Annotated[int, typer.Option(
    "--max-context", help="--prompts bfcl*: skip (and count) cases longer than this (the "
    "server's --max-model-len is at least this)")]
FidelityConcurrency = Annotated[str, typer.Option(
    "--fidelity-concurrency", help="Fidelity requests in flight at once, comma-separated "
    "levels (each a full fidelity pass)")]
Repair = Annotated[int, typer.Option(
    "--repair", help="The phased policies (repaired, guarded, variants*): tokens computed "
    "in context at the start of each spliced skill (rounded up to the block size)")]
EngineCheck = Annotated[bool, typer.Option(
    "--engine-check", help="Also compose the fidelity prompts in kvnotes' engine from the "
    "notebooks the server splices, and count the server's answers equal to the engine's "
    "(after the server stops)")]
Via = Annotated[str, typer.Option(
    "--via", help="Where the measured requests go: vllm (token ids planned by "
    "ComposeClient) or front (text prompts to kvnotes' OpenAI front, which plans them; "
    "needs --launch)")]


@dataclass(frozen=True)
class SkillsCommand:
    """What ``serve-bench skills`` runs: the benchmark's config, the server, the skill folder
    the library is published to, and whether skills are compiled behind the system header."""

    bench: SkillsBenchConfig
    server: ServerOptions
    skills_dir: Path | None = None
    anchor: bool = True

    def __post_init__(self) -> None:
        if self.server.url and self.skills_dir is None:
            raise typer.BadParameter("serve-bench skills --url needs --skills DIR: the folder "
                                     "the server was started with (the benchmark publishes its "
                                     "skills there)")
        if self.server.url and self.bench.via == "front":
            raise typer.BadParameter("--via front needs --launch: the benchmark starts the "
                                     "front and reaches the vLLM behind it for the exact answers")
        if self.skills_dir is not None:
            folder_option(self.skills_dir, "--skills")

    def run(self) -> Written:
        """Run it and write the bundle in ``--out``."""
        import kvnotes
        from kvnotes_bench.serving.runs import run_skills
        from kvnotes_bench.serving.skills_report import write_outputs

        engine = kvnotes.load(self.server.model)
        self.server.out.mkdir(parents=True, exist_ok=True)
        # the longest prompt a BFCL set keeps (multi_turn manuals run to ~6k tokens), within
        # what the model was trained on
        longest = max(4096, self.bench.max_context)
        limit = engine.adapter.max_positions
        target = self.server.target(max_model_len=min(longest, limit) if limit else longest)
        result = run_skills(self.bench, target, engine,
                            skills_dir=self.skills_dir or self.server.out / "skills",
                            anchor=self.anchor, log=say)
        result = dataclasses.replace(result, command=invocation())
        data = result.to_dict()
        return data, write_outputs(data, self.server.out)


@bench_app.command("skills")
def skills(
    url: Url = None, launch: Launch = False, model: Model = _default("model"),
    k: K = _default("k"), requests: Requests = _default("requests"),
    concurrency: Concurrency = None, policies: Policies = None,
    fidelity_samples: FidelitySamples = _default("fidelity_samples"),
    guard_tau: GuardTau = None,
    calibration_samples: CalibrationSamples = _default("calibration_samples"),
    skills_dir: SkillsDir = None, no_anchor: NoAnchor = False,
    prompts: Prompts = _default("prompts"), cases: Cases = _default("cases"),
    max_context: MaxContext = _default("max_context"),
    fidelity_concurrency: FidelityConcurrency = ",".join(
        map(str, _default("fidelity_concurrency"))),
    repair: Repair = _default("repair"),
    engine_check: EngineCheck = _default("engine_check"),
    via: Via = _default("via"),
    dtype: Dtype = "auto", block_size: BlockSize = None,
    kv_cache_gib: KvCacheGib = default_of(ServerOptions, "kv_cache_gib"),
    startup_timeout: StartupTimeout = default_of(ServerOptions, "startup_timeout"),
    vllm_python: VllmPython = None,
    request_timeout: RequestTimeout = default_of(ServerOptions, "request_timeout"),
    out: Out = default_of(ServerOptions, "out"), as_json: AsJson = False,
) -> None:
    """Composed skills vs prefix caching vs cold inside vLLM: TTFT, hit rate, fidelity.

    Skills are spliced by kvnotes' connector, bare (compose) or with each skill's first tokens
    computed in context by phased requests (repaired, guarded); fidelity compares each
    spliced policy's answers with the same prompts sent exactly."""
    from kvnotes_bench.serving.skills_report import markdown

    server = ServerOptions(
        url=url, launch=launch, model=model, dtype=dtype, block_size=block_size,
        kv_cache_gib=kv_cache_gib, startup_timeout=startup_timeout, vllm_python=vllm_python,
        request_timeout=request_timeout, out=out)
    bench = SkillsBenchConfig(
        model=model, k=k, requests=requests,
        concurrency=(int_list(concurrency, "--concurrency") if concurrency
                     else _default("concurrency")),
        policies=name_list(policies, DEFAULT_POLICIES), fidelity_samples=fidelity_samples,
        guard_tau=guard_tau, calibration_samples=calibration_samples, prompts=prompts,
        cases=cases, max_context=max_context, via=via, repair=repair, engine_check=engine_check,
        fidelity_concurrency=int_list(fidelity_concurrency, "--fidelity-concurrency"))
    data, paths = SkillsCommand(bench=bench, server=server, skills_dir=skills_dir,
                                anchor=not no_anchor).run()
    print_result(data, paths, markdown(data), as_json)
