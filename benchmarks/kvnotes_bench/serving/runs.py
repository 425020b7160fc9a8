"""A serving benchmark against a running server or one that kvnotes launches for it.

:class:`Target` says where the requests go: ``url`` (a loopback server someone started) or
``launch`` (a :class:`~kvnotes.serving.launch.LaunchConfig`: the one launcher starts it, the run
goes against it, and it is stopped when the run ends). :func:`run_erratum` and
:func:`run_skills` are what ``kvnotes-bench serve erratum`` / ``skills`` run;
:func:`run_erratum_rows` measures several erratum configurations on one launched server (the
benchmark scripts in ``benchmarks/serve_quiet/``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvnotes.core.errors import InvalidArgumentError
from kvnotes.serving.launch import launcher as launcher
from kvnotes.serving.vllm_endpoints import Client
from kvnotes_bench.serving.erratum import ErratumBenchConfig, ErratumResult, run_benchmark
from kvnotes_bench.serving.report import markdown_table, write_outputs

if TYPE_CHECKING:
    from kvnotes.core.engine import Engine
    from kvnotes_bench.serving.prompt_sets import PromptSet
    from kvnotes_bench.serving.skills import SkillsResult
    from kvnotes_bench.serving.skills_config import SkillsBenchConfig

__all__ = ["Target", "erratum_launch", "run_erratum", "run_erratum_rows",
           "run_skills"]

# the chat template, the question and each edit's correction around a context (tokens)
PROMPT_ROOM = 120
EDIT_ROOM = 30
RESCAN_S = 1.0  # a running connector rescans its skill folder at most every 0.25 s


@dataclass(frozen=True)
class Target:
    """Where a benchmark's requests go: exactly one of a running server's ``url`` and a
    server to ``launch``; ``request_timeout_s`` bounds each request."""

    url: str | None = None
    launch: launcher.LaunchConfig | None = None
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if (self.url is None) == (self.launch is None):
            raise InvalidArgumentError("pass exactly one of --url URL (a running server) or "
                                       "--launch (kvnotes starts one)")
        if self.request_timeout_s <= 0:
            raise InvalidArgumentError(f"--request-timeout must be positive, got "
                                       f"{self.request_timeout_s}")


def erratum_launch(base: launcher.LaunchConfig, config: ErratumBenchConfig) -> launcher.LaunchConfig:
    """``base`` with room for ``config``'s longest prompt: when ``base.max_model_len`` is None,
    the longest context with its errata, question and answer, rounded up to 1024 (at least
    4096), within the model's positions."""
    if base.max_model_len is not None:
        return base
    needed = (max(config.context_tokens + config.optional_contexts) + PROMPT_ROOM
              + EDIT_ROOM * config.edits + config.max_tokens)
    positions = launcher.export_model(base.model, base.dtype).max_positions
    return dataclasses.replace(base, max_model_len=min(max(4096, -(-needed // 1024) * 1024),
                                                        positions))


def run_erratum(config: ErratumBenchConfig, target: Target, *,
                log: Callable[[str], None] = print) -> ErratumResult:
    """The erratum benchmark on ``target`` (a launched server is stopped when it ends)."""
    if target.url is not None:
        return run_benchmark(Client(target.url, timeout=target.request_timeout_s), config,
                             log=log)
    assert target.launch is not None  # Target's invariant
    launch = launcher.prepare(erratum_launch(target.launch, config))
    config = dataclasses.replace(config, model=launch.server.served_name,
                                 block_size=launch.config.block_size)
    log(f"starting vLLM on {launch.model.folder} ({launch.model.dtype}, max-model-len "
        f"{launch.max_model_len}, block size {launch.config.block_size or 'default'}); log: "
        f"{launch.server.log_path}")
    with launch:
        log(f"server up at {launch.url} (pid {launch.server.pid}) after "
            f"{launch.server.startup_s:.0f} s")
        result = run_benchmark(Client(launch.url, timeout=target.request_timeout_s), config,
                               log=log)
    result.launch = launch.record()
    log(f"server stopped (pid {launch.server.pid})")
    return result


def run_erratum_rows(rows: Sequence[tuple[str, ErratumBenchConfig]], launch: launcher.LaunchConfig, *,
                     out: Path, how: str, request_timeout_s: float = 1800.0,
                     log: Callable[[str], None] = print) -> None:
    """Several erratum configurations, in order, on one launched server: each result is written
    to ``out/<name>/`` as soon as it finishes; ``how`` (the command that ran them) goes into
    every result."""
    if not rows:
        raise InvalidArgumentError("no rows to run: name at least one")
    fitted = launch
    for _, config in rows:  # room for the longest prompt of any row
        fitted = dataclasses.replace(fitted, max_model_len=max(
            fitted.max_model_len or 0, erratum_launch(launch, config).max_model_len or 0))
    server = launcher.prepare(fitted)
    with server:
        log(f"[{time.strftime('%T')}] server up at {server.url} after "
            f"{server.server.startup_s:.0f} s")
        for name, config in rows:
            config = dataclasses.replace(config, model=server.server.served_name,
                                         block_size=fitted.block_size)
            log(f"[{time.strftime('%T')}] {name}")
            result = run_benchmark(Client(server.url, timeout=request_timeout_s), config, log=log)
            result.launch, result.how = server.record(), how
            data = result.to_dict()
            write_outputs(data, out / name)
            log(markdown_table(data))
    log(f"[{time.strftime('%T')}] done")


def run_skills(config: SkillsBenchConfig, target: Target, engine: Engine, *,
               skills_dir: Path, anchor: bool = True,
               log: Callable[[str], None] = print) -> SkillsResult:
    """The skills benchmark on ``target``: its prompt set's library is published to
    ``skills_dir`` (with ``url``: the folder that server was started with), then every phase and
    fidelity run. ``config.via == "front"`` needs ``launch``: the launched server gets kvnotes'
    OpenAI front, and the measured requests go through it."""
    # the skills workload imports the agent's library: only loaded when it runs
    from kvnotes.serving.compose_client import ComposeClient
    from kvnotes_bench.serving.skills import run_skills_benchmark
    from kvnotes_bench.serving.skills_config import config_prompt_set

    prompts = config_prompt_set(config, engine.tokenizer)
    if target.url is not None:
        if config.via == "front":
            raise InvalidArgumentError("--via front needs --launch (the benchmark starts the "
                                       "front and reaches vLLM behind it directly for the exact "
                                       "references)")
        from kvnotes.serving.skills import ServingSkills

        published = ServingSkills(skills_dir, engine)
        prompts.register(published, anchor=anchor, log=log)
        time.sleep(RESCAN_S)
        client = ComposeClient(target.url, config.model, engine.tokenizer,
                               timeout=target.request_timeout_s, skills=published.folder)
        result = run_skills_benchmark(client, config, anchor=anchor, prompt_set=prompts, log=log)
        return _with_engine_check(result, engine, prompts, skills_dir, anchor=anchor, log=log)
    assert target.launch is not None  # Target's invariant
    base = dataclasses.replace(target.launch, skills=skills_dir)
    if config.via == "front":
        from kvnotes.serving.front.app import FrontConfig

        base = dataclasses.replace(base, front=base.front or FrontConfig(
            timeout=target.request_timeout_s))
    launch = launcher.prepare(base, engine)
    assert launch.skills is not None  # the connector is on: prepare made the library
    prompts.register(launch.skills, anchor=anchor, log=log)
    variants = None
    if config.declares_variants:
        from kvnotes_bench.serving.skills import declared_pairs
        from kvnotes_bench.serving.skills_variants import declare_variants

        # the variants the policies' requests will want, compiled before the server starts
        variants = declare_variants(launch.skills, declared_pairs(config, prompts),
                                    names=skill_names(prompts), log=log)
    log(f"starting vLLM ({launch.model.dtype}) with the kvnotes connector"
        + (" and the OpenAI front" if config.via == "front" else "")
        + f"; log: {launch.server.log_path}")
    with launch:
        log(f"server up at {launch.url} after {launch.server.startup_s:.0f} s")
        name = launch.server.served_name
        # vLLM itself: the exact references (and every request unless via the front)
        client = ComposeClient(launch.server.url, name, engine.tokenizer,
                               timeout=target.request_timeout_s, skills=launch.skills.folder)
        front = (ComposeClient(launch.url, name, engine.tokenizer,
                               timeout=target.request_timeout_s)
                 if config.via == "front" else None)
        result = run_skills_benchmark(client, dataclasses.replace(config, model=name),
                                      anchor=anchor, prompt_set=prompts, front=front,
                                      variants=variants, log=log)
    result.launch = launch.record()
    # after the server is down: the engine gets the machine to itself
    return _with_engine_check(result, engine, prompts, skills_dir, anchor=anchor, log=log)


def skill_names(prompts: PromptSet) -> dict[str, str]:
    """A prompt set's skill names by their text (empty when it names none)."""
    from kvnotes_bench.serving.prompt_sets import AirlinePrompts, BfclPrompts, skill_texts

    if isinstance(prompts, BfclPrompts):
        return {text: name for name, text in prompts.skills.items()}
    if isinstance(prompts, AirlinePrompts):
        return {text: name for name, text in skill_texts().items()}
    return {}


def _with_engine_check(result: SkillsResult, engine: Engine, prompts: PromptSet,
                       skills_dir: Path, *, anchor: bool, log: Callable[[str], None]
                       ) -> SkillsResult:
    """``result`` with the engine's answers to its fidelity prompts beside the server's, when
    the run asked for them (``config.engine_check``) and measured fidelity."""
    from kvnotes_bench.serving.engine_check import check_against_engine, engine_answers
    from kvnotes_bench.serving.skills_fidelity import fidelity_prompts

    config = result.config
    block = result.server.block_size if result.server is not None else None
    if not config.engine_check or not result.fidelity or block is None:
        return result
    answers = engine_answers(engine, fidelity_prompts(prompts, config), skills_dir,
                             anchor=anchor, block_size=block, repair_tokens=config.repair,
                             tokens=config.fidelity_tokens,
                             variants=config.declares_variants, log=log)
    result.engine_check = check_against_engine(answers, result.fidelity, tau=result.guard_tau,
                                               prompt_set=prompts)
    for c in result.engine_check:
        log(f"engine check {c.policy} (concurrency {c.concurrency}): server = engine "
            f"{c.server_equals_engine}/{c.samples} (exact {c.exact_equals_engine}/{c.samples}); "
            f"engine first token {c.engine_first_token}/{c.samples}")
    return result
