"""``kvnotes serve MODEL``: vLLM with kvnotes' connector behind the OpenAI front.

Every setting is a field of :class:`~kvnotes.serving.config_file.ServeConfig`, which a config
file sets (``--config FILE``, TOML or YAML; ``examples/serve.toml`` lists every key). The most
used ones are options too, generated here from
:data:`~kvnotes.serving.config_file.FLAGS` and the fields (type, default, description as the
help): an option given on the command line wins over the file. Every default is the library's
(the front's repair, the served model's calibrated guard, a learning server's KV block size,
the learning bounds), so ``kvnotes serve MODEL --skills DIR`` runs what
``LaunchConfig(front=FrontConfig())`` runs.
"""

from __future__ import annotations

import inspect
import time
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Union

import typer
from typer._click.core import ParameterSource

from kvnotes.cli.app import app, read_text_file
from kvnotes.cli.skills import skill_files
from kvnotes.core.errors import ServingError
from kvnotes.serving.config_file import (
    FLAGS,
    ServeConfig,
    field_info,
    load_serve_config,
)

if TYPE_CHECKING:
    from kvnotes.serving.launch.launcher import Launch

__all__ = ["MOVED", "ServeConfig", "log_requests_to_stderr", "run_serve", "serve"]

# The options ``kvnotes serve`` took before ``--config``, and the key of the file that sets each
# now (docs/guide/serving.md has the same table).
MOVED: dict[str, str] = {
    "--model": "model (or MODEL, the argument)", "--skill": "skill", "--header": "header",
    "--metrics-key": "auth.metrics_key", "--block-size": "block_size",
    "--vllm-python": "vllm_python", "--log": "log", "--startup-timeout": "startup_timeout",
    "--request-log": "request_log", "--learn-after": "learning.after",
    "--learn-min-tokens": "learning.min_tokens", "--library-cap": "learning.library_cap",
    "--tenant-quota": "learning.tenant_quota", "--learn-max-variants": "learning.max_variants",
    "--learn-compile-nice": "learning.compile_nice",
    "--store-password-file": "store.password_file",
}


# ---- the options, generated -------------------------------------------------------------------
def _param_name(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _plain(annotation: Any) -> Any:
    """The type click parses an option as: ``annotation`` without None and without pydantic's
    checks (``Annotated[str, BeforeValidator(...)] | None`` is ``str``; the config checks the
    value afterwards)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)] \
        if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is Union \
        else [annotation]
    (kind,) = args  # every option's setting has one type
    return typing.get_args(kind)[0] if typing.get_origin(kind) is Annotated else kind


def _option(key: str, flag: str) -> inspect.Parameter:
    """The option for setting ``key``: its field's type (optional: left out, the file's or the
    default holds), its description as help, its default shown."""
    info = field_info(key)
    default = info.get_default(call_default_factory=True)
    shown = default not in (None, False, ())
    kind: Any = bool if info.annotation is bool else Union[_plain(info.annotation), None]  # noqa: UP007
    option = typer.Option(flag, help=info.description,
                          show_default=str(default) if shown else False)
    return inspect.Parameter(_param_name(flag), inspect.Parameter.KEYWORD_ONLY,
                             default=False if kind is bool else None,
                             annotation=Annotated[kind, option])


def _parameters() -> list[inspect.Parameter]:
    """The command's parameters: MODEL, the options of :data:`FLAGS`, ``--config`` and the vLLM
    flags after ``--``."""
    kw = inspect.Parameter.KEYWORD_ONLY
    model = inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                              annotation=Annotated[str | None, typer.Argument(
                                  metavar="MODEL", show_default=False,
                                  help=f"{field_info('model').description} (default: the "
                                  "file's model, else smollm2-135m)")])
    config = inspect.Parameter("config", kw, default=None, annotation=Annotated[
        Path | None, typer.Option("--config", metavar="FILE", help=(
            "TOML or YAML file of settings, every one (sections limits, auth, learning, store; "
            "examples/serve.toml lists them); an option given here wins over it"))])
    vllm_args = inspect.Parameter("vllm_args", kw, default=None, annotation=Annotated[
        list[str] | None, typer.Argument(metavar="[-- VLLM_FLAGS...]", help=(
            "vLLM flags after --, passed unchanged (e.g. -- --tensor-parallel-size 2 "
            "--gpu-memory-utilization 0.8); what the connector cannot run with is refused"))])
    ctx = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                            annotation=typer.Context)
    return [ctx, model, *(_option(k, f) for k, f in FLAGS.items()), config, vllm_args]


def _given(ctx: typer.Context, values: Mapping[str, object]) -> dict[str, object]:
    """The settings the command line gave (by key): options left at their default are not,
    so the file's value holds. ``values``: click's, each of its option's type
    (:class:`ServeConfig` checks them)."""
    given = {key: values[_param_name(flag)] for key, flag in FLAGS.items()
             if ctx.get_parameter_source(_param_name(flag)) not in (None,
                                                                    ParameterSource.DEFAULT)}
    model, raw_args = values["model"], values["vllm_args"]
    vllm_args = [str(a) for a in raw_args] if isinstance(raw_args, (list, tuple)) else []
    if isinstance(model, str) and model.startswith("-"):
        # no MODEL before `--`: click took the first vLLM flag for it (a model never starts
        # with "-")
        vllm_args = [model, *vllm_args]
        model = None
    if model is not None:
        given["model"] = model
    if vllm_args:
        given["vllm_args"] = tuple(vllm_args)
    return given


def _serve(ctx: typer.Context, **values: Any) -> None:
    """Run vLLM (prefix caching on) with kvnotes' connector behind an OpenAI-compatible front:
    registered skills found in a request's prompt are spliced (their first tokens recomputed in
    context) for any OpenAI client. Stops on Ctrl-C.

    Every setting is also a key of --config FILE; the options below are the most used.
    """
    run_serve(load_serve_config(values["config"], given=_given(ctx, values)))


# typer reads the command's parameters from its signature: the generated one
_SIGNATURE = inspect.Signature(_parameters())
_serve.__signature__ = _SIGNATURE  # type: ignore[attr-defined]
_serve.__annotations__ = {p.name: p.annotation for p in _SIGNATURE.parameters.values()}
serve = app.command("serve", epilog=(
    "Moved to --config (key in the file): " + "; ".join(
        f"{flag} -> {key}" for flag, key in MOVED.items())))(_serve)


# ---- the run ----------------------------------------------------------------------------------
def run_serve(opts: ServeConfig) -> None:
    """Start what ``opts`` asks for and serve until Ctrl-C (or vLLM exits: an error). No
    model is loaded here: vLLM holds the only copy and compiles the configured skills once it
    is up."""
    from kvnotes.serving.front.guard_defaults import resolve_guard
    from kvnotes.serving.launch import launcher

    front = opts.front_config()
    if front is not None:
        typer.echo(f"guard: {resolve_guard(opts.guard, opts.model)[1]}", err=True)
    config = opts.launch_config(front)
    texts = skill_files(list(opts.skill))
    head = read_text_file(opts.header, "header") if opts.header else None
    launch = launcher.prepare(config)
    server = launch.server
    if head:
        launch.register(head, "header")
    for name, text in texts:
        launch.register(text, name, after=head)
    assert launch.skills is not None  # config.skills is set
    typer.echo(f"starting vLLM for {opts.model} (log: {server.log_path}); skills in "
               f"{launch.skills.folder}", err=True)
    if opts.request_log and front is not None:
        log_requests_to_stderr()
    with launch:
        for info in launch.registered:
            typer.echo(f"skill {info.name}: {len(info)} tokens", err=True)
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


def _say_served(launch: Launch, opts: ServeConfig) -> None:
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
