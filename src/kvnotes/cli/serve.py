"""``kvnotes serve``: vLLM with kvnotes' connector behind the OpenAI front.

The command gathers its options in :class:`ServeOptions` (one field per option: a new option is
a field, an ``Annotated`` alias and a line in :func:`serve`), which turns them into the
library's configs (:meth:`ServeOptions.front_config`, :meth:`ServeOptions.launch_config`). Every
default is the library's: an option left out is a field the config leaves at its own default
(the front's repair, the served model's calibrated guard, a learning server's KV block size,
the learning bounds), so ``kvnotes serve`` runs what ``LaunchConfig(front=FrontConfig())`` runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvnotes.cli.app import app, folder_option, read_text_file
from kvnotes.cli.options import default_of
from kvnotes.cli.skills import skill_files
from kvnotes.core.errors import InvalidArgumentError, ServingError
from kvnotes.core.repair import Repair, parse_repair, repair_spelling
from kvnotes.serving.front.config import FrontConfig, LearnConfig
from kvnotes.serving.launch.launcher import LaunchConfig

if TYPE_CHECKING:
    from kvnotes.serving.launch.launcher import Launch

FRONT_REPAIR = repair_spelling(FrontConfig().repair_for(None))


# ---- the options ------------------------------------------------------------------------------
Model = Annotated[str, typer.Option("--model", help="Model alias, .gguf file or HF folder")]
Skills = Annotated[Path, typer.Option(
    "--skills", help="Skill-library folder (created if missing); skills registered there are "
    "spliced, also while the server runs")]
SkillFiles = Annotated[list[Path] | None, typer.Option(
    "--skill", help="Text file to register as a skill at start (repeatable; its name is the "
    "file's stem)")]
Header = Annotated[Path | None, typer.Option(
    "--header", help="Text file of the system header requests start with: registered as a "
    "piece, and --skill files are compiled behind it (closer to a full prefill)")]
Port = Annotated[int | None, typer.Option(
    "--port", help="Port clients use (the OpenAI front's, or vLLM's with --no-front; default: "
    "a free one)")]
Host = Annotated[str, typer.Option(
    "--host", help="Address the front listens on (0.0.0.0: every interface; give --api-key or "
    "--key-file then). vLLM itself stays on 127.0.0.1")]
ApiKey = Annotated[str | None, typer.Option(
    "--api-key", envvar="KVNOTES_API_KEY", help="Key clients must send (Authorization: Bearer "
    "KEY) on /v1 and /kvnotes")]
KeyFile = Annotated[Path | None, typer.Option(
    "--key-file", help='JSON {"keys": {"KEY": {"tenant": "NAME"}}}: each key\'s requests are '
    "spliced in its tenant")]
MetricsKey = Annotated[str | None, typer.Option(
    "--metrics-key", envvar="KVNOTES_METRICS_KEY", help="A key for the front's /metrics alone "
    "(a scraper's); with keys on, /metrics needs it or --api-key")]
NoFront = Annotated[bool, typer.Option(
    "--no-front", help="Serve vLLM on --port directly, with no OpenAI front (clients send token "
    "ids, a splice request and its salt themselves, e.g. ComposeClient)")]
RepairOption = Annotated[str | None, typer.Option(
    "--repair", help="Front: what each spliced skill recomputes in context: K its first K "
    "tokens (0: a bare splice), K@F at least the share F of it (e.g. 32@0.1), rounded up to "
    f"the block (default: the front's, {FRONT_REPAIR})")]
Guard = Annotated[str, typer.Option(
    "--guard", help="Front: answer from an exact request when the first token's top-2 "
    "log-prob margin is under this tau: auto (the model's calibrated default, off for a model "
    "without one), 0 (never) or a margin such as 0.5")]
Dtype = Annotated[str, typer.Option(
    "--dtype", help="Server dtype: auto (bfloat16 where the CPU has native bf16, else "
    "float32), float32 or bfloat16")]
BlockSize = Annotated[int | None, typer.Option(
    "--block-size", help="vLLM KV block size (CPU: a multiple of 32; default 128, "
    f"{default_of(LearnConfig, 'block_size')} with --learn)")]
MaxModelLen = Annotated[int, typer.Option("--max-model-len")]
KvCacheGib = Annotated[float, typer.Option(
    "--kv-cache-gib", help="CPU KV cache size in whole GiB (vLLM's CPU build takes no "
    "fractions)")]
VllmPython = Annotated[str | None, typer.Option(
    "--vllm-python", help="Python of the vLLM environment (default .venv-vllm/bin/python)")]
Log = Annotated[Path | None, typer.Option("--log", help="Server log file (default: in $TMPDIR)")]
StartupTimeout = Annotated[float, typer.Option("--startup-timeout")]
RequestLog = Annotated[bool, typer.Option(
    "--request-log/--no-request-log", help="One JSON line per request on stderr (the front's "
    "INFO log: id, tenant, plan, outcome)")]
Learn = Annotated[bool, typer.Option(
    "--learn", help="Front: learn the chunks requests carry (each tools entry, each text "
    "content part): compiled in the background once seen --learn-after times per tenant, then "
    "spliced; no request waits for a compile")]
LearnAfter = Annotated[int, typer.Option(
    "--learn-after", help="With --learn: the sighting at which a chunk is compiled")]
LearnMinTokens = Annotated[int, typer.Option(
    "--learn-min-tokens", help="With --learn: shorter chunks are never learned")]
LibraryCap = Annotated[str | None, typer.Option(
    "--library-cap", help="With --learn: bytes of learned entries kept (e.g. 256MiB, 1GB: "
    "K/M/G are powers of 1000, KiB/MiB/GiB of 1024); least recently used evicted beyond it "
    "(default: no cap)")]
TenantQuota = Annotated[str | None, typer.Option(
    "--tenant-quota", help="With --learn: bytes of learned entries one tenant keeps (e.g. "
    "64MiB)")]
LearnMaxVariants = Annotated[int, typer.Option(
    "--learn-max-variants", min=1, help="With --learn: learned entries kept per skill (the "
    "skill behind each predecessor seen --learn-after times before it); least recently used "
    "evicted beyond it")]
LearnCompileNice = Annotated[int, typer.Option(
    "--learn-compile-nice", min=0, max=19, help="With --learn: the compile thread's nice "
    "value; on a saturated core it gets a fixed share (15: 3.4%, 19: 1.4%, 0: half), on an "
    "idle one all of it")]
StoreUrl = Annotated[str | None, typer.Option(
    "--store", help="A Redis store the fleet of hosts shares (redis://HOST:PORT/DB, rediss:// "
    "for TLS; the password in the URL or in --store-password-file): its entries are copied "
    "into --skills in the background, and with --learn sightings, compiles and the library's "
    "cap are the fleet's. Default: this host's folder alone")]
StorePasswordFile = Annotated[Path | None, typer.Option(
    "--store-password-file", help="File whose first line is the store's password (kept out "
    "of the URL and the process list)")]
VllmArgs = Annotated[list[str] | None, typer.Argument(
    metavar="[-- VLLM_FLAGS...]", help="vLLM flags after --, passed unchanged (e.g. -- "
    "--tensor-parallel-size 2 --gpu-memory-utilization 0.8); what the connector cannot run "
    "with is refused")]


@dataclass(frozen=True)
class ServeOptions:
    """``kvnotes serve``'s options, one field each (defaults: the library configs')."""

    skills: Path
    model: str = default_of(LaunchConfig, "model")
    skill: tuple[Path, ...] = ()
    header: Path | None = None
    port: int | None = None
    host: str = default_of(FrontConfig, "host")
    api_key: str | None = None
    key_file: Path | None = None
    metrics_key: str | None = None
    no_front: bool = False
    repair: str | None = None
    guard: str = "auto"
    dtype: str = default_of(LaunchConfig, "dtype")
    block_size: int | None = None
    max_model_len: int = default_of(LaunchConfig, "max_model_len")
    kv_cache_gib: float = default_of(LaunchConfig, "kv_cache_gib")
    vllm_python: str | None = None
    log: Path | None = None
    startup_timeout: float = default_of(LaunchConfig, "startup_timeout")
    request_log: bool = True
    learn: bool = False
    learn_after: int = default_of(LearnConfig, "after")
    learn_min_tokens: int = default_of(LearnConfig, "min_tokens")
    library_cap: str | None = None
    tenant_quota: str | None = None
    learn_max_variants: int = default_of(LearnConfig, "max_variants")
    learn_compile_nice: int = default_of(LearnConfig, "compile_nice")
    store: str | None = None
    store_password_file: Path | None = None
    vllm_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        """The refusals that need no model (a bad option fails before any weights load)."""
        from kvnotes.serving.front.guard_defaults import parse_guard
        from kvnotes.serving.vllm.checks import check_vllm_args

        if self.no_front and (self.api_key or self.key_file or self.metrics_key
                              or self.host != default_of(FrontConfig, "host")):
            raise InvalidArgumentError("--host, --api-key, --key-file and --metrics-key are the "
                                       "front's: drop --no-front, or pass vLLM's own flags "
                                       "after --")
        if self.no_front and self.learn:
            raise InvalidArgumentError("--learn is the front's (it sees the requests' chunks): "
                                       "drop --no-front")
        if not self.learn and (self.library_cap is not None or self.tenant_quota is not None):
            raise InvalidArgumentError("--library-cap and --tenant-quota bound learned "
                                       "entries: add --learn")
        self._check_store()
        check_vllm_args(list(self.vllm_args))
        parse_guard(self.guard)
        if self.repair is not None:
            server_repair_spelled(self.repair)

    def _check_store(self) -> None:
        """``--store``'s URL and password file, read before any weights load."""
        from kvnotes.serving.store.url import parse_store_url, read_password_file

        if self.store is None:
            if self.store_password_file is not None:
                raise InvalidArgumentError("--store-password-file is the --store's: add "
                                           "--store redis://HOST:PORT/DB")
            return
        if self.no_front:
            raise InvalidArgumentError("--store is the front's (it mirrors and learns): drop "
                                       "--no-front")
        if not parse_store_url(self.store).is_redis:
            raise InvalidArgumentError("--store takes a redis:// or rediss:// URL (this "
                                       "host's own folder is --skills)")
        if self.store_password_file is not None:
            read_password_file(self.store_password_file)

    def learn_config(self) -> LearnConfig | None:
        """The front's learning (None without ``--learn``)."""
        if not self.learn:
            return None
        return LearnConfig(after=self.learn_after, min_tokens=self.learn_min_tokens,
                           library_cap=_size(self.library_cap, "--library-cap"),
                           tenant_quota=_size(self.tenant_quota, "--tenant-quota"),
                           max_variants=self.learn_max_variants,
                           compile_nice=self.learn_compile_nice)

    def front_config(self) -> FrontConfig | None:
        """The front's settings (None with ``--no-front``); a bad key file fails here."""
        from kvnotes.serving.front.guard_defaults import parse_guard

        if self.no_front:
            return None
        front = FrontConfig(port=self.port, host=self.host, guard=parse_guard(self.guard),
                            api_key=self.api_key, key_file=self.key_file,
                            metrics_key=self.metrics_key, learn=self.learn_config(),
                            store=self.store, store_password_file=self.store_password_file)
        if self.repair is not None:
            plan = server_repair_spelled(self.repair)
            front = replace(front, repair=plan.first, repair_share=plan.share)
        front.keys  # noqa: B018 -- a bad key file fails before the model loads
        return front

    def launch_config(self, front: FrontConfig | None) -> LaunchConfig:
        """The launch: vLLM with the connector over ``--skills``, and ``front`` before it."""
        from kvnotes.serving.launch.process import check_kv_cache_gib

        return LaunchConfig(
            model=self.model, dtype=self.dtype, block_size=self.block_size,
            kv_cache_gib=check_kv_cache_gib(self.kv_cache_gib),
            max_model_len=self.max_model_len, port=self.port if self.no_front else None,
            skills=folder_option(self.skills, "--skills"), log_path=self.log,
            startup_timeout=self.startup_timeout, vllm_python=self.vllm_python, front=front,
            extra_args=self.vllm_args)


def _size(text: str | None, what: str) -> int | None:
    from kvnotes.core.sizes import parse_size

    return None if text is None else parse_size(text, what)


def server_repair_spelled(spec: str) -> Repair:
    """``--repair``'s spelling as the front's repair: ``K`` or ``K@F``; the adaptive rule
    (``~T``) is refused, a server plans its phases before the request runs."""
    plan = parse_repair(spec)
    if plan.adapt is not None:
        raise InvalidArgumentError(
            f"--repair {spec}: the adaptive rule (~T) runs in the engine only (it sizes each "
            "region from the notes it recomputed, which the server's phases never read back); "
            "give K or K@F, e.g. --repair 32@0.1")
    return plan


# ---- the command ------------------------------------------------------------------------------
@app.command("serve")
def serve(
    skills: Skills, model: Model = default_of(LaunchConfig, "model"),
    skill: SkillFiles = None, header: Header = None, port: Port = None,
    host: Host = default_of(FrontConfig, "host"), api_key: ApiKey = None,
    key_file: KeyFile = None, metrics_key: MetricsKey = None, no_front: NoFront = False,
    repair: RepairOption = None, guard: Guard = "auto",
    dtype: Dtype = default_of(LaunchConfig, "dtype"), block_size: BlockSize = None,
    max_model_len: MaxModelLen = default_of(LaunchConfig, "max_model_len"),
    kv_cache_gib: KvCacheGib = default_of(LaunchConfig, "kv_cache_gib"),
    vllm_python: VllmPython = None, log: Log = None,
    startup_timeout: StartupTimeout = default_of(LaunchConfig, "startup_timeout"),
    request_log: RequestLog = True, learn: Learn = False,
    learn_after: LearnAfter = default_of(LearnConfig, "after"),
    learn_min_tokens: LearnMinTokens = default_of(LearnConfig, "min_tokens"),
    library_cap: LibraryCap = None, tenant_quota: TenantQuota = None,
    learn_max_variants: LearnMaxVariants = default_of(LearnConfig, "max_variants"),
    learn_compile_nice: LearnCompileNice = default_of(LearnConfig, "compile_nice"),
    store: StoreUrl = None, store_password_file: StorePasswordFile = None,
    vllm_args: VllmArgs = None,
) -> None:
    """Run vLLM (prefix caching on) with kvnotes' connector behind an OpenAI-compatible front:
    registered skills found in a request's prompt are spliced (their first tokens recomputed in
    context) for any OpenAI client. Stops on Ctrl-C."""
    run_serve(ServeOptions(
        skills=skills, model=model, skill=tuple(skill or ()), header=header, port=port,
        host=host, api_key=api_key, key_file=key_file, metrics_key=metrics_key,
        no_front=no_front, repair=repair, guard=guard, dtype=dtype, block_size=block_size,
        max_model_len=max_model_len, kv_cache_gib=kv_cache_gib, vllm_python=vllm_python,
        log=log, startup_timeout=startup_timeout, request_log=request_log, learn=learn,
        learn_after=learn_after, learn_min_tokens=learn_min_tokens, library_cap=library_cap,
        tenant_quota=tenant_quota, learn_max_variants=learn_max_variants,
        learn_compile_nice=learn_compile_nice, store=store,
        store_password_file=store_password_file, vllm_args=tuple(vllm_args or ())))


def run_serve(opts: ServeOptions) -> None:
    """Start what ``opts`` asks for and serve until Ctrl-C (or vLLM exits: an error)."""
    import kvnotes
    from kvnotes.serving.front.guard_defaults import resolve_guard
    from kvnotes.serving.launch import launcher

    front = opts.front_config()
    if front is not None:
        typer.echo(f"guard: {resolve_guard(opts.guard, opts.model)[1]}", err=True)
    config = opts.launch_config(front)
    texts = skill_files(list(opts.skill))
    head = read_text_file(opts.header, "--header") if opts.header else None
    launch = launcher.prepare(config, kvnotes.load(opts.model))
    lib, server = launch.skills, launch.server
    assert lib is not None  # config.skills is set
    if head:
        lib.add(head, name="header")
    for name, text in texts:
        info = lib.add(text, name=name, after=head)
        typer.echo(f"skill {name}: {len(info)} tokens", err=True)
    typer.echo(f"starting vLLM for {opts.model} (log: {server.log_path}); skills in "
               f"{lib.folder}", err=True)
    if opts.request_log and front is not None:
        log_requests_to_stderr()
    with launch:
        _say_served(launch, opts)
        typer.echo(launch.url)
        try:
            while server.proc is not None and server.proc.poll() is None:
                time.sleep(1.0)
        except KeyboardInterrupt:
            typer.echo("stopping the server", err=True)
            return
    code = server.proc.returncode if server.proc else "?"
    raise ServingError(f"the vLLM server exited with code {code}; log: {server.log_path}\n"
                       f"{server.log_tail(20)}")


def _say_served(launch: Launch, opts: ServeOptions) -> None:
    """Where the server is and what it does, on stderr."""
    from kvnotes.serving.front.config import busy_core_share

    server = launch.server
    if launch.front is None:
        typer.echo(f"serving {server.served_name} at {server.url}/v1 (pid {server.pid}); "
                   "send prompts as token ids with a splice request and its salt to splice "
                   "(kvnotes.serving.SpliceRequest.leading, splice_salt); "
                   "Ctrl-C stops", err=True)
        return
    keys = len(launch.front.service.keys)
    typer.echo(f"serving {server.served_name} at {launch.url}/v1 (OpenAI front; "
               f"{f'{keys} key(s)' if keys else 'no key'}); registered skills in "
               "prompts are spliced; Ctrl-C stops", err=True)
    learning = launch.front.config.learn
    if learning is not None:
        typer.echo(f"  learning: chunks of {learning.after} sightings and "
                   f"{learning.min_tokens}+ tokens; cap {learning.library_cap or 'none'} "
                   f"bytes, tenant quota {learning.tenant_quota or 'none'} bytes; variants of "
                   f"skills behind predecessors seen {learning.after} times, "
                   f"{learning.max_variants} kept per skill; compiles at nice "
                   f"{learning.compile_nice} ({busy_core_share(learning.compile_nice):.1%} of "
                   f"a busy core); vLLM blocks of {launch.config.block_size}", err=True)
    link = launch.front.service.store
    if link is not None:
        typer.echo(f"  store: {link.store.url}, mirrored into {link.mirror.folder}"
                   + ("; sightings, compiles and the cap are the fleet's"
                      if link.learner is not None else ""), err=True)
    typer.echo(f"  front metrics: {launch.url}/metrics; request log: "
               f"{'stderr, one JSON line each' if opts.request_log else 'off'}", err=True)
    typer.echo(f"  vLLM (pid {server.pid}): {server.url}, metrics: {server.url}/metrics",
               err=True)


def log_requests_to_stderr() -> None:
    """The front's per-request INFO lines (JSON objects) on stderr, as they are."""
    import logging
    import sys

    front_log = logging.getLogger("kvnotes.serving.front")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    front_log.addHandler(handler)
    front_log.setLevel(logging.INFO)
    front_log.propagate = False  # the line is printed once, whatever the root logger does
