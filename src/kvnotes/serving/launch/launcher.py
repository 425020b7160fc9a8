"""The one way kvnotes starts a vLLM server: a :class:`LaunchConfig` in, a running server out.

:func:`prepare` exports a vLLM-ready copy of the model, builds the command line and environment
and returns a :class:`Launch`; entering it starts the server and waits until it is healthy,
leaving it stops the server. With ``LaunchConfig.skills`` set, the server loads
:class:`~kvnotes.serving.vllm.connector.KvnotesConnector` over that skill library (the model is first
checked to be splicable exactly, and the serving manifest written); without it, it is plain vLLM
with prefix caching. With ``LaunchConfig.front`` set too, the OpenAI front
(:mod:`kvnotes.serving.front.app`) runs in front of it: vLLM listens on a free loopback port, the
front on ``front.port``, and :attr:`Launch.url` is the front's (it listens before vLLM starts
and stops before vLLM does). ``kvnotes serve``, ``kvnotes-bench serve`` and the benchmark scripts all
start their servers here.

Example:
    >>> from kvnotes.serving.launch.launcher import LaunchConfig, prepare          # doctest: +SKIP
    >>> with prepare(LaunchConfig(model="smollm2-135m", kv_cache_gib=2)) as launch:  # doctest: +SKIP
    ...     print(launch.url)
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.machine import preferred_dtype
from kvnotes.serving.json_types import JsonObject
from kvnotes.serving.launch.export import export_hf_dir
from kvnotes.serving.launch.paths import SOURCE_ROOT
from kvnotes.serving.launch.process import VLLMServer, check_kv_cache_gib

if TYPE_CHECKING:
    from kvnotes.core.engine import Engine
    from kvnotes.serving.front.app import Front, FrontConfig
    from kvnotes.serving.front.config import LearnConfig
    from kvnotes.serving.learning import Learner
    from kvnotes.serving.library.splice import PieceInfo
    from kvnotes.serving.skills import ServingSkills

log = logging.getLogger("kvnotes.serving.launch")

CONNECTOR_CLASS = "KvnotesConnector"
CONNECTOR_MODULE = "kvnotes.serving.vllm.connector"
DTYPES = ("auto", "float32", "bfloat16", "float16")


def cpu_dtype() -> str:
    """bfloat16 where the CPU computes it natively (avx512_bf16 / amx_bf16), else float32:
    bfloat16 without native support runs several times slower on vLLM's CPU build."""
    return str(preferred_dtype()).removeprefix("torch.")


EMULATED_BF16 = ("bfloat16 on a CPU without avx512_bf16 or amx_bf16 is emulated and runs many "
                 "times slower on vLLM's CPU build; --dtype auto serves float32 here")


AUTO_TOOL_PARSER = "auto"


def chat_template_text(folder: Path) -> str:
    """The chat template an HF folder ships (``chat_template.jinja``, else the tokenizer
    config's), or "" when it has none."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text("utf-8")
    try:
        cfg = json.loads((folder / "tokenizer_config.json").read_text("utf-8"))
    except (OSError, ValueError):
        return ""
    template = cfg.get("chat_template") if isinstance(cfg, dict) else None
    if isinstance(template, list):  # named templates: the default one, else all of them
        named = {t.get("name"): t.get("template", "") for t in template if isinstance(t, dict)}
        template = named.get("default") or "\n".join(str(t) for t in named.values())
    return template if isinstance(template, str) else ""


def tool_call_parser(folder: Path) -> str | None:
    """vLLM's tool parser for the model in ``folder``, read from its chat template: ``hermes``
    for a template that asks for calls in ``<tool_call>`` tags (Qwen2.5, Hermes, SmolLM3),
    else None (the template has no tool calls vLLM can parse; requests with tools still
    work, answered as content).

    The front parses a spliced answer's calls the hermes way too
    (:mod:`kvnotes.serving.front.tool_calls`), so a tools request is answered with the same
    ``tool_calls`` spliced or not."""
    template = chat_template_text(folder)
    return "hermes" if "<tool_call>" in template and "tools" in template else None


def tool_args(parser: str | None, extra_args: tuple[str, ...], folder: Path) -> list[str]:
    """The vLLM flags that turn on tool calling: ``parser`` ``auto`` reads the model's chat
    template (:func:`tool_call_parser`), None turns it off, a name is vLLM's parser name.
    Flags already in ``extra_args`` win."""
    if parser is None or any(a.startswith("--tool-call-parser") for a in extra_args):
        return []
    name = tool_call_parser(folder) if parser == AUTO_TOOL_PARSER else parser
    if name is None:
        return []
    auto = [] if "--enable-auto-tool-choice" in extra_args else ["--enable-auto-tool-choice"]
    return [*auto, "--tool-call-parser", name]


def kv_transfer_config(skills_folder: Path, *, max_gib: float = 2.0) -> JsonObject:
    """vLLM's ``--kv-transfer-config`` for kvnotes' connector over one model's skills folder.

    ``kv_load_failure_policy`` is ``recompute``: a skill that cannot be read when its KV is
    loaded (deleted or damaged since it was planned) is prefilled instead, where vLLM's default
    (``fail``) would fail the request and the co-batched ones sharing its blocks.
    """
    return {"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"skills": str(skills_folder), "max_gib": max_gib}}


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """How to start one vLLM server.

    Args:
        model: a bundled alias, a ``.gguf`` file or an HF folder (exported for vLLM).
        dtype: ``auto`` (:func:`cpu_dtype`), ``float32``, ``bfloat16`` or ``float16``.
        block_size: vLLM's KV block size (None: the front's ``learn.block_size`` for a
            learning front, else vLLM's default, 128 on the CPU build).
        kv_cache_gib: the CPU KV cache, in whole GiB (vLLM's CPU build reads it with ``int()``).
        max_model_len: the longest prompt plus answer (None: the model's
            ``max_position_embeddings``).
        port: the port on 127.0.0.1 (None: a free one).
        skills: a skill-library root: the connector is on and splices the skills published
            there (None: plain vLLM, no connector).
        connector_max_gib: the bound on skill tensors the connector keeps in memory.
        extra_args: more vLLM command-line arguments.
        log_path: the server's log (None: ``$TMPDIR/kvnotes-vllm-<port>.log``).
        startup_timeout: seconds to wait for the server to become healthy.
        vllm_python: the Python of the vLLM environment (None: ``$KVNOTES_VLLM_PYTHON`` or
            ``.venv-vllm/bin/python``).
        served_name: the model name clients ask for (None: the alias, or the file's stem).
        front: the OpenAI front's settings (its ``upstream`` is left None: the launched
            server's; needs ``skills``), or None: clients talk to vLLM directly.
        tool_parser: vLLM's tool-call parser: ``auto`` (the one the model's chat template
            asks for, :func:`tool_call_parser`; none when it asks for none), a parser name,
            or None (tool calling off).
    """

    model: str = "smollm2-135m"
    dtype: str = "auto"
    block_size: int | None = None
    kv_cache_gib: int = 2
    max_model_len: int | None = 4096
    port: int | None = None
    skills: Path | None = None
    connector_max_gib: float = 2.0
    extra_args: tuple[str, ...] = ()
    log_path: Path | None = None
    startup_timeout: float = 900.0
    vllm_python: str | None = None
    served_name: str | None = None
    front: FrontConfig | None = None
    tool_parser: str | None = AUTO_TOOL_PARSER

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_gib", check_kv_cache_gib(self.kv_cache_gib))
        if self.dtype not in DTYPES:
            raise InvalidArgumentError(f"dtype {self.dtype!r}: use one of {', '.join(DTYPES)}")
        if self.block_size is None and self.front is not None and self.front.learn is not None:
            object.__setattr__(self, "block_size", self.front.learn.block_size)
        if self.block_size is not None and self.block_size <= 0:
            raise InvalidArgumentError(f"block_size {self.block_size}: use a positive number "
                                       "of tokens (vLLM's CPU build wants a multiple of 32)")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise InvalidArgumentError(f"max_model_len {self.max_model_len}: use a positive "
                                       "number of tokens, or None for the model's limit")
        if self.skills is not None:
            object.__setattr__(self, "skills", Path(self.skills))
        elif self.front is not None:
            raise InvalidArgumentError("LaunchConfig.front needs skills (the library the front "
                                       "finds in prompts): set skills, or front=None")
        if self.log_path is not None:
            object.__setattr__(self, "log_path", Path(self.log_path))
        object.__setattr__(self, "extra_args", tuple(str(a) for a in self.extra_args))

    @property
    def name(self) -> str:
        """The served model name."""
        if self.served_name:
            return self.served_name
        return Path(self.model).stem if Path(self.model).exists() else self.model


@dataclass(frozen=True, slots=True)
class ExportedModel:
    """A vLLM-ready copy of a model."""

    folder: Path
    dtype: str  # resolved: never "auto"
    max_positions: int  # config.json's max_position_embeddings


def export_model(model: str, dtype: str = "auto") -> ExportedModel:
    """Export ``model`` for vLLM in ``dtype`` (``auto``: :func:`cpu_dtype`); an up-to-date
    export is reused, so calling this before :func:`prepare` costs a few file stats."""
    served = cpu_dtype() if dtype == "auto" else dtype
    if served == "bfloat16" and cpu_dtype() != "bfloat16":
        log.warning(EMULATED_BF16)
    folder = export_hf_dir(model, dtype=served)
    cfg = json.loads((folder / "config.json").read_text("utf-8"))
    return ExportedModel(folder, served, int(cfg.get("max_position_embeddings") or 1 << 30))


@dataclass(frozen=True, slots=True)
class LaunchRecord:
    """What was launched, for a result file (``to_dict()`` at the JSON boundary)."""

    model_dir: str
    dtype: str
    block_size: int | None
    max_model_len: int
    kv_cache_gib: int
    connector: bool
    command: list[str]
    startup_s: float | None
    pid: int | None
    stopped: bool

    def to_dict(self) -> JsonObject:
        return asdict(self)


@dataclass
class Launch:
    """A prepared server (from :func:`prepare`): ``with launch:`` runs it.

    ``skills`` is the library to publish skills to when the connector is on, else None. Without
    an engine in this process, its skills are compiled by the server once it is up:
    :meth:`register` queues them until then (``with launch:`` returns once they are written,
    and the front's ``/health`` is a 503 until then).
    """

    config: LaunchConfig
    model: ExportedModel
    server: VLLMServer
    max_model_len: int
    skills: ServingSkills | None = field(default=None)
    front: Front | None = field(default=None)
    registered: list[PieceInfo] = field(default_factory=list)
    _pending: list[tuple[str, str, str | None]] = field(default_factory=list)
    _up: bool = False

    @property
    def url(self) -> str:
        """The URL clients use: the front's when there is one, else vLLM's."""
        return self.front.url if self.front is not None else self.server.url

    def register(self, text: str, name: str, *, after: str | None = None) -> None:
        """Publish skill ``text`` behind ``after`` (a header's text): now when this process
        can compile it (an engine, or the server is up), else once the server is up."""
        if self.skills is None:
            raise InvalidArgumentError("this launch has no skill library (LaunchConfig.skills)")
        if not self.skills.offline and not self._up:
            self._pending.append((text, name, after))
        else:
            self.registered.append(self.skills.add(text, name=name, after=after))

    def __enter__(self) -> Launch:
        # the front listens first: a port in use fails at once, not after vLLM's minutes of
        # start-up (until vLLM is up, the front's /health answers 502)
        if self.front is not None:
            self.front.start()
        try:
            self.server.__enter__()
            self._up = True
            self._compile_pending()
        except BaseException:
            self._up = False
            if self.front is not None:
                self.front.stop()
            if self.server.proc is not None:
                self.server.__exit__(None, None, None)
            raise
        return self

    def _compile_pending(self) -> None:
        """The skills queued before the server was up (and a BOS model's start entry),
        compiled by it; then the front is ready."""
        if self.skills is not None:
            self.skills.start_entry()
            pending, self._pending = self._pending, []
            for text, name, after in pending:
                self.registered.append(self.skills.add(text, name=name, after=after))
        if self.front is not None and self.front.desk is not None:
            self.front.desk.ready.set()

    def __exit__(self, *exc: object) -> None:
        self._up = False
        try:
            if self.front is not None:
                self.front.stop()
        finally:
            self.server.__exit__(*exc)

    def record(self) -> LaunchRecord:
        return LaunchRecord(
            model_dir=str(self.model.folder), dtype=self.model.dtype,
            block_size=self.config.block_size, max_model_len=self.max_model_len,
            kv_cache_gib=self.config.kv_cache_gib, connector=self.skills is not None,
            command=list(self.server.cmd), startup_s=self.server.startup_s, pid=self.server.pid,
            stopped=self.server.proc is not None and not self.server.alive_pids())


def prepare(config: LaunchConfig, engine: Engine | None = None) -> Launch:
    """Export the model and build a (not yet started) server for ``config``.

    With ``config.skills`` set, a model whose keys the connector cannot move exactly is refused
    (:class:`~kvnotes.UnsupportedModelError`, before anything starts) and the serving manifest
    is written, from the model's files (:class:`~kvnotes.serving.library.model_facts.ModelFacts`:
    no weights are loaded; vLLM holds the only copy and compiles the skills). ``engine`` (the
    same model, loaded by kvnotes) makes the library compile in this process instead. A plain
    launch never reads the model here.
    """
    skills: ServingSkills | None = None
    extra = list(config.extra_args)
    if config.skills is not None:
        from kvnotes.serving.skills import ServingSkills
        from kvnotes.serving.vllm.checks import check_vllm_args

        check_vllm_args(config.extra_args)  # what the connector cannot run with, before anything
        # checks the scheme, writes the manifest
        skills = ServingSkills(config.skills, engine if engine is not None else config.model)
        extra += ["--kv-transfer-config",
                  json.dumps(kv_transfer_config(skills.folder, max_gib=config.connector_max_gib))]
    exported = export_model(config.model, config.dtype)
    extra += tool_args(config.tool_parser, config.extra_args, exported.folder)
    if config.block_size:
        extra += ["--block-size", str(config.block_size)]
    max_model_len = config.max_model_len or exported.max_positions
    # the server's Python imports kvnotes from this source tree (it lives in another venv)
    env = {"PYTHONPATH": os.pathsep.join(
        p for p in (str(SOURCE_ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    server = VLLMServer(exported.folder, served_name=config.name, python=config.vllm_python,
                        port=config.port, log_path=config.log_path, max_model_len=max_model_len,
                        dtype=exported.dtype, kv_cache_gib=config.kv_cache_gib,
                        extra_args=extra, env=env, startup_timeout=config.startup_timeout)
    front = None
    if skills is not None:
        from kvnotes.serving.server_prefill import VllmPrefill

        if not skills.offline:  # compiles go to the server, in its numerics
            skills.attach(VllmPrefill(server.url, config.name,
                                      api_key=vllm_api_key(config.extra_args)), exported.dtype)
        if config.front is not None:
            front = _front(config, config.front, server.url, skills, exported.dtype)
    return Launch(config, exported, server, max_model_len, skills, front)


def vllm_api_key(args: tuple[str, ...]) -> str | None:
    """The key vLLM checks: its ``--api-key`` flag, else ``$VLLM_API_KEY`` (None: none)."""
    from kvnotes.serving.front.config import VLLM_API_KEY_ENV

    for i, arg in enumerate(args):
        if arg == "--api-key" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--api-key="):
            return arg.split("=", 1)[1]
    return os.environ.get(VLLM_API_KEY_ENV) or None


def _front(config: LaunchConfig, front: FrontConfig, upstream: str, skills: ServingSkills,
           dtype: str) -> Front:
    """The front over ``skills`` (its tokenizer) with its learner and a desk for registering
    skills on the running server."""
    from kvnotes.serving.front.app import Front
    from kvnotes.serving.front.skill_desk import SkillDesk
    from kvnotes.serving.planning.match import SkillCatalog

    settings = replace(front, upstream=upstream,
                       block_size=front.block_size or config.block_size,
                       model=front.model or config.name,
                       upstream_api_key=front.upstream_api_key or vllm_api_key(config.extra_args))
    learner: Learner | None = None
    if front.learn is not None and front.store is not None:  # the fleet's, over its store
        from kvnotes.serving.front.store_link import fleet_learner

        learner = fleet_learner(settings, skills, dtype)
    elif front.learn is not None:
        learner = _vllm_learner(front.learn, skills, settings, dtype)
    return Front(settings, SkillCatalog(skills.folder, skills.tokenizer), learner,
                 SkillDesk(skills))


def _vllm_learner(learn: LearnConfig, skills: ServingSkills, settings: FrontConfig,
                  dtype: str) -> Learner:
    """A learner whose compiles are the server's own prefill, saved by its connector (no
    model in this process is used for them; ``dtype``: the server's, the entries' numerics)."""
    from kvnotes.serving.learning import Learner
    from kvnotes.serving.learning.compiles import VllmCompiler
    from kvnotes.serving.library.registry import LearnedRegistry
    from kvnotes.serving.server_prefill import EntryAddress, VllmPrefill

    assert settings.upstream is not None and settings.model is not None
    registry = LearnedRegistry(skills.folder)
    client = VllmPrefill(settings.upstream, settings.model, api_key=settings.upstream_api_key)
    compiler = VllmCompiler(skills.folder, registry, EntryAddress.of(skills.manifest, dtype),
                            client)
    return Learner(learn, skills, registry, compiler=compiler)
