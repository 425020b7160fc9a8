"""``kvnotes serve`` and ``kvnotes skills``: vLLM with kvnotes' connector, and its skills folder."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from kvnotes.cli.app import app, folder_option, read_text_file
from kvnotes.core.errors import InvalidArgumentError, ServingError
from kvnotes.core.repair import SERVER_REPAIR, Repair, parse_repair, repair_spelling
from kvnotes.serving.front.config import DEFAULT_COMPILE_NICE

# vLLM's KV block for a learning server: repair regions are rounded up to blocks, and agent
# traffic's chunks are short, so at the CPU build's default 128 rounding costs 14-16 points of
# the spliced share (docs/results.md, agent traffic)
LEARN_BLOCK_SIZE = 32

if TYPE_CHECKING:
    from kvnotes.serving.front.config import LearnConfig
    from kvnotes.serving.library.registry import LearnedEntry


# ---- composition inside vLLM ---------------------------------------------------------------------
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


def _skill_files(paths: list[Path] | None) -> list[tuple[str, str]]:
    return [(p.stem, read_text_file(p, "--skill")) for p in (paths or [])]


@app.command("serve")
def serve(
    model: str = typer.Option("smollm2-135m", "--model", help="Model alias, .gguf file or HF folder"),
    skills: Path = typer.Option(..., "--skills", help="Skill-library folder (created if missing); "
                                "skills registered there are spliced, also while the server runs"),
    skill: list[Path] | None = typer.Option(None, "--skill", help="Text file to register as a skill at "
                                     "start (repeatable; its name is the file's stem)"),
    header: Path | None = typer.Option(None, "--header", help="Text file of the system header requests "
                                "start with: registered as a piece, and --skill files are "
                                "compiled behind it (closer to a full prefill)"),
    port: int | None = typer.Option(None, "--port", help="Port clients use (the OpenAI front's, or "
                             "vLLM's with --no-front; default: a free one)"),
    host: str = typer.Option("127.0.0.1", "--host", help="Address the front listens on "
                             "(0.0.0.0: every interface; give --api-key or --key-file then). "
                             "vLLM itself stays on 127.0.0.1"),
    api_key: str | None = typer.Option(None, "--api-key", envvar="KVNOTES_API_KEY", help="Key clients "
                                "must send (Authorization: Bearer KEY) on /v1 and /kvnotes"),
    key_file: Path | None = typer.Option(None, "--key-file", help='JSON {"keys": {"KEY": {"tenant": '
                                  '"NAME"}}}: each key\'s requests are spliced in its tenant'),
    metrics_key: str | None = typer.Option(None, "--metrics-key", envvar="KVNOTES_METRICS_KEY",
                                           help="A key for the front's /metrics alone (a "
                                           "scraper's); with keys on, /metrics needs it or "
                                           "--api-key"),
    no_front: bool = typer.Option(False, "--no-front", help="Serve vLLM on --port directly, "
                                  "with no OpenAI front (clients send token ids and the splice "
                                  "salt themselves, e.g. ComposeClient)"),
    repair: str = typer.Option(repair_spelling(SERVER_REPAIR), "--repair", help="Front: what "
                               "each spliced skill recomputes in context: K its first K tokens "
                               "(0: a bare splice), K@F at least the share F of it (e.g. "
                               "32@0.1), rounded up to the block"),
    guard: str = typer.Option("auto", "--guard", help="Front: answer from an exact request "
                              "when the first token's top-2 log-prob margin is under this tau: "
                              "auto (the model's calibrated default, off for a model without "
                              "one), 0 (never) or a margin such as 0.5"),
    dtype: str = typer.Option("auto", "--dtype", help="Server dtype: auto (bfloat16 where the "
                              "CPU has native bf16, else float32), float32 or bfloat16"),
    block_size: int | None = typer.Option(None, "--block-size", help="vLLM KV block size (CPU: a "
                                          "multiple of 32; default 128, 32 with --learn)"),
    max_model_len: int = typer.Option(4096, "--max-model-len"),
    kv_cache_gib: float = typer.Option(2, "--kv-cache-gib", help="CPU KV cache size in whole "
                                       "GiB (vLLM's CPU build takes no fractions)"),
    vllm_python: str | None = typer.Option(None, "--vllm-python", help="Python of the vLLM environment "
                                           "(default .venv-vllm/bin/python)"),
    log: Path | None = typer.Option(None, "--log", help="Server log file (default: in $TMPDIR)"),
    startup_timeout: float = typer.Option(900.0, "--startup-timeout"),
    request_log: bool = typer.Option(True, "--request-log/--no-request-log", help="One JSON "
                                     "line per request on stderr (the front's INFO log: id, "
                                     "tenant, plan, outcome)"),
    learn: bool = typer.Option(False, "--learn", help="Front: learn the chunks requests carry "
                               "(each tools entry, each text content part): compiled in the "
                               "background once seen --learn-after times per tenant, then "
                               "spliced; no request waits for a compile"),
    learn_after: int = typer.Option(2, "--learn-after", help="With --learn: the sighting at "
                                    "which a chunk is compiled"),
    learn_min_tokens: int = typer.Option(32, "--learn-min-tokens", help="With --learn: "
                                         "shorter chunks are never learned"),
    library_cap: str | None = typer.Option(None, "--library-cap", help="With --learn: bytes of "
                                           "learned entries kept (e.g. 256MiB); least recently "
                                           "used evicted beyond it (default: no cap)"),
    tenant_quota: str | None = typer.Option(None, "--tenant-quota", help="With --learn: bytes "
                                            "of learned entries one tenant keeps (e.g. 64MiB)"),
    learn_max_variants: int = typer.Option(4, "--learn-max-variants", min=1, help="With "
                                           "--learn: learned entries kept per skill (the "
                                           "skill behind each predecessor seen --learn-after "
                                           "times before it); least recently used evicted "
                                           "beyond it"),
    learn_compile_nice: int = typer.Option(
        DEFAULT_COMPILE_NICE, "--learn-compile-nice", min=0, max=19, help="With --learn: the "
        "compile thread's nice value; on a saturated core it gets a fixed share (15: 3.4%, "
        "19: 1.4%, 0: half), on an idle one all of it"),
    vllm_args: list[str] | None = typer.Argument(None, metavar="[-- VLLM_FLAGS...]", help="vLLM "
                                          "flags after --, passed unchanged (e.g. -- "
                                          "--tensor-parallel-size 2 --gpu-memory-utilization "
                                          "0.8); what the connector cannot run with is refused"),
) -> None:
    """Run vLLM (prefix caching on) with kvnotes' connector behind an OpenAI-compatible front:
    registered skills found in a request's prompt are spliced (their first tokens recomputed in
    context) for any OpenAI client. Stops on Ctrl-C."""
    import kvnotes
    from kvnotes.serving.front.app import FrontConfig
    from kvnotes.serving.front.config import busy_core_share
    from kvnotes.serving.front.guard_defaults import resolve_guard
    from kvnotes.serving.launch.launcher import LaunchConfig, prepare
    from kvnotes.serving.launch.process import check_kv_cache_gib
    from kvnotes.serving.library.manifest import SPLICE_SALT
    from kvnotes.serving.vllm.checks import check_vllm_args

    if no_front and (api_key or key_file or metrics_key or host != "127.0.0.1"):
        raise InvalidArgumentError("--host, --api-key, --key-file and --metrics-key are the "
                                   "front's: drop --no-front, or pass vLLM's own flags after --")
    check_vllm_args(vllm_args or [])
    plan = server_repair_spelled(repair)
    tau, why = resolve_guard(guard, model)
    learning = learn_config(learn, learn_after, learn_min_tokens, library_cap, tenant_quota,
                            learn_max_variants, learn_compile_nice)
    block_size = serve_block_size(block_size, learn=learning is not None)
    if no_front and learning is not None:
        raise InvalidArgumentError("--learn is the front's (it sees the requests' chunks): "
                                   "drop --no-front")
    front = None if no_front else FrontConfig(port=port, host=host, repair=plan.first,
                                              repair_share=plan.share, guard=tau,
                                              api_key=api_key, key_file=key_file,
                                              metrics_key=metrics_key, learn=learning)
    if front is not None:
        front.keys  # noqa: B018 -- a bad key file fails before the model loads
        typer.echo(f"guard: {why}", err=True)
    config = LaunchConfig(model=model, dtype=dtype, block_size=block_size,
                          kv_cache_gib=check_kv_cache_gib(kv_cache_gib), max_model_len=max_model_len,
                          port=port if no_front else None,
                          skills=folder_option(skills, "--skills"), log_path=log,
                          startup_timeout=startup_timeout, vllm_python=vllm_python, front=front,
                          extra_args=tuple(vllm_args or ()))
    texts = _skill_files(skill)
    head = read_text_file(header, "--header") if header else None
    launch = prepare(config, kvnotes.load(model))
    lib, server = launch.skills, launch.server
    assert lib is not None  # config.skills is set
    if head:
        lib.add(head, name="header")
    for name, text in texts:
        info = lib.add(text, name=name, after=head)
        typer.echo(f"skill {name}: {len(info)} tokens", err=True)
    typer.echo(f"starting vLLM for {model} (log: {server.log_path}); skills in {lib.folder}",
               err=True)
    if request_log and front is not None:
        log_requests_to_stderr()
    with launch:
        if launch.front is not None:
            keys = len(launch.front.service.keys)
            typer.echo(f"serving {server.served_name} at {launch.url}/v1 (OpenAI front; "
                       f"{f'{keys} key(s)' if keys else 'no key'}); registered skills in "
                       "prompts are spliced; Ctrl-C stops", err=True)
            if learning is not None:
                typer.echo(f"  learning: chunks of {learning.after} sightings and "
                           f"{learning.min_tokens}+ tokens; cap "
                           f"{learning.library_cap or 'none'} bytes, tenant quota "
                           f"{learning.tenant_quota or 'none'} bytes; variants of skills "
                           f"behind predecessors seen {learning.after} times, "
                           f"{learning.max_variants} kept per skill; compiles at nice "
                           f"{learning.compile_nice} ({busy_core_share(learning.compile_nice):.1%}"
                           f" of a busy core); vLLM blocks of {block_size}", err=True)
            typer.echo(f"  front metrics: {launch.url}/metrics; request log: "
                       f"{'stderr, one JSON line each' if request_log else 'off'}", err=True)
            typer.echo(f"  vLLM (pid {server.pid}): {server.url}, metrics: {server.url}/metrics",
                       err=True)
        else:
            typer.echo(f"serving {server.served_name} at {server.url}/v1 (pid {server.pid}); "
                       f"send prompts as token ids with cache_salt={SPLICE_SALT!r} to splice; "
                       "Ctrl-C stops", err=True)
        typer.echo(launch.url)
        try:
            while server.proc is not None and server.proc.poll() is None:
                time.sleep(1.0)
        except KeyboardInterrupt:
            typer.echo("stopping the server", err=True)
            return
    raise ServingError(f"the vLLM server exited with code {server.proc.returncode if server.proc else '?'}"
                       f"; log: {server.log_path}\n{server.log_tail(20)}")


def serve_block_size(block_size: int | None, *, learn: bool) -> int | None:
    """vLLM's KV block for ``kvnotes serve``: the one given, else :data:`LEARN_BLOCK_SIZE` for
    a learning server, else vLLM's default (None)."""
    if block_size is None and learn:
        return LEARN_BLOCK_SIZE
    return block_size


def learn_config(learn: bool, after: int, min_tokens: int, library_cap: str | None,
                 tenant_quota: str | None, max_variants: int = 4,
                 compile_nice: int = DEFAULT_COMPILE_NICE) -> LearnConfig | None:
    """The front's :class:`LearnConfig` from ``kvnotes serve``'s flags (None without --learn;
    a bound given without --learn is an error, not ignored)."""
    from kvnotes.serving.front.config import LearnConfig, parse_size

    if not learn:
        if library_cap is not None or tenant_quota is not None:
            raise InvalidArgumentError("--library-cap and --tenant-quota bound learned "
                                       "entries: add --learn")
        return None
    return LearnConfig(after=after, min_tokens=min_tokens,
                       library_cap=None if library_cap is None else parse_size(library_cap),
                       tenant_quota=None if tenant_quota is None else parse_size(tenant_quota),
                       max_variants=max_variants, compile_nice=compile_nice)


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


skills_app = typer.Typer(help="Skills a `kvnotes serve` server splices.", no_args_is_help=True)
app.add_typer(skills_app, name="skills")


@skills_app.command("add")
def skills_add(
    files: list[Path] = typer.Argument(..., help="Text files, one skill each (name: file stem)"),
    model: str = typer.Option("smollm2-135m", "--model"),
    skills: Path = typer.Option(..., "--skills", help="The folder given to `kvnotes serve`"),
    header: Path | None = typer.Option(None, "--header", help="Compile the skills behind this system "
                                       "header (as `kvnotes serve --header`)"),
    after: str | None = typer.Option(None, "--after", help="Compile them as variants behind the "
                                     "header and this registered skill (the one that precedes "
                                     "them in requests)"),
    max_variants: int = typer.Option(4, "--max-variants", min=1, help="Variants kept per skill "
                                     "(the oldest are deleted)"),
) -> None:
    """Compile skills with kvnotes and publish them (a running server picks them up)."""
    import kvnotes
    from kvnotes.serving.skills import ServingSkills

    texts = _skill_files(files)
    head = read_text_file(header, "--header") if header else None
    folder_option(skills, "--skills")
    lib = ServingSkills(skills, kvnotes.load(model), max_variants=max_variants)
    prefix: str | list[int] | None = head if after is None else lib.after_skill(after, header=head)
    for name, text in texts:
        info = lib.add(text, name=name, after=prefix)
        typer.echo(f"{name}\t{len(info)} tokens\t{info.key}"
                   + (f"\tafter {after}" if after else ""))


@skills_app.command("list")
def skills_list(
    model: str = typer.Option("smollm2-135m", "--model"),
    skills: Path = typer.Option(..., "--skills"),
) -> None:
    """The skills a server for this model would splice: the registered ones, then the chunks
    and variants learned on sight (`kvnotes serve --learn`) with their tenant, what a variant
    is of and behind, its size and its use (hits, of them exactly placed)."""
    import kvnotes
    from kvnotes.serving.library.registry import LearnedRegistry, registry_path
    from kvnotes.serving.skills import ServingSkills

    lib = ServingSkills(skills, kvnotes.load(model))
    learned: dict[str, LearnedEntry] = {}
    if registry_path(lib.folder).is_file():
        with LearnedRegistry(lib.folder) as reg:
            learned = {e.key: e for e in reg.entries()}
    for group in lib.variants():
        kept = [v for v in group.variants if v.piece.key not in learned]
        if not kept:
            continue
        typer.echo(f"{group.name}\t{len(group.token_ids)} tokens\t{len(kept)} "
                   f"variant(s)\t{sum(v.bytes for v in kept)} bytes"
                   + (f"\ttenant {group.tenant}" if group.tenant else ""))
        for v in kept:
            typer.echo(f"  position {v.piece.origin}\tbehind {len(v.piece.behind)} tokens\t"
                       f"{v.bytes} bytes\t{v.piece.key}")
    for e in sorted(learned.values(), key=lambda e: -e.last_used):
        used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.last_used))
        what = (f"variant of {e.variant_of}\tbehind {e.behind or '?'} ({e.behind_tokens} "
                "tokens)" if e.variant_of is not None else f"{e.kind}\tbehind "
                f"{e.behind_tokens} tokens")
        typer.echo(f"learned {e.name}\t{what}\ttenant {e.tenant or '-'}\t{e.tokens} tokens\t"
                   f"{e.bytes} bytes\t{e.hits} hits ({e.exact} exact)\tlast used {used}\t"
                   f"{'pinned' if e.pinned else 'evictable'}\t{e.key}")


def _learned_home(skills: Path, key: str) -> tuple[Path, str]:
    """``(serving folder, full key)`` of learned entry ``key`` (or a unique prefix of it) under
    skills root ``skills``, whatever the model; a clear error when no folder has it."""
    from kvnotes.serving.library.registry import REGISTRY_DIR, LearnedRegistry, registry_path

    root = folder_option(skills, "--skills")
    if len(key) < 6 or not key.isalnum():
        raise InvalidArgumentError(f"{key!r} is not an entry key: give the key shown by "
                                   "`kvnotes skills list` (or its first 6+ characters)")
    folders = [p.parent.parent for p in sorted(root.glob(f"*/{REGISTRY_DIR}/*"))
               if p == registry_path(p.parent.parent)]
    found: list[tuple[Path, str]] = []
    errors: list[str] = []
    for folder in folders:
        with LearnedRegistry(folder) as reg:
            try:
                found.append((folder, reg.resolve(key)))
            except InvalidArgumentError as err:
                errors.append(str(err))
    if len(found) == 1:
        return found[0]
    if len(found) > 1:
        raise InvalidArgumentError(f"{key!r} names entries of {len(found)} models: give more "
                                   "of the key")
    registered = sorted(p.stem for p in root.glob(f"*/{key}*.safetensors"))
    if registered:
        raise InvalidArgumentError(f"{key!r} is a registered skill ({registered[0]}), not a "
                                   "learned one: registered skills are never evicted; delete "
                                   "its file to unregister it")
    why = next((e for e in errors if "names" in e or "not an entry key" in e), None)
    raise InvalidArgumentError(why or f"no learned entry {key!r} under {root} (see `kvnotes "
                               "skills list`)")


@skills_app.command("pin")
def skills_pin(
    key: str = typer.Argument(..., help="A learned entry's key (or its first 6+ characters)"),
    skills: Path = typer.Option(..., "--skills", help="The folder given to `kvnotes serve`"),
    unpin: bool = typer.Option(False, "--unpin", help="Make it evictable again"),
) -> None:
    """Keep a learned chunk: a pinned entry is never evicted (by the cap or a quota)."""
    from kvnotes.serving.library.registry import LearnedRegistry

    folder, full = _learned_home(skills, key)
    with LearnedRegistry(folder) as reg:
        reg.pin(full, not unpin)
    typer.echo(f"{full}\t{'evictable' if unpin else 'pinned'}")


@skills_app.command("forget")
def skills_forget(
    key: str = typer.Argument(..., help="A learned entry's key (or its first 6+ characters)"),
    skills: Path = typer.Option(..., "--skills", help="The folder given to `kvnotes serve`"),
) -> None:
    """Drop a learned chunk: its file and its registry row (a running server stops splicing
    it at its next rescan; a request already planned with it recomputes those tokens)."""
    from kvnotes.serving.library.registry import LearnedRegistry, forget

    folder, full = _learned_home(skills, key)
    with LearnedRegistry(folder) as reg:
        forget(folder, full, reg)
    typer.echo(f"{full}\tforgotten")
