"""``kvnotes serve`` and ``kvnotes skills``: vLLM with kvnotes' connector, and its skills folder."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from kvnotes.cli.app import app, folder_option, read_text_file
from kvnotes.core.errors import ServingError


# ---- composition inside vLLM ---------------------------------------------------------------------
def _skill_files(paths: list[Path] | None) -> list[tuple[str, str]]:
    return [(p.stem, read_text_file(p, "--skill")) for p in (paths or [])]


@app.command("serve")
def serve(
    model: str = typer.Option("smollm2-135m", "--model", help="Model alias, .gguf file or HF folder"),
    skills: Path = typer.Option(..., "--skills", help="Skill-library folder (created if missing); "
                                "skills registered there are spliced, also while the server runs"),
    skill: list[Path] = typer.Option(None, "--skill", help="Text file to register as a skill at "
                                     "start (repeatable; its name is the file's stem)"),
    header: Path = typer.Option(None, "--header", help="Text file of the system header requests "
                                "start with: registered as a piece, and --skill files are "
                                "compiled behind it (closer to a full prefill)"),
    port: int = typer.Option(None, "--port", help="Port on 127.0.0.1 (default: a free one)"),
    dtype: str = typer.Option("auto", "--dtype", help="Server dtype: auto (bfloat16 where the "
                              "CPU has native bf16, else float32), float32 or bfloat16"),
    block_size: int = typer.Option(None, "--block-size", help="vLLM KV block size (CPU: a "
                                   "multiple of 32; default 128)"),
    max_model_len: int = typer.Option(4096, "--max-model-len"),
    kv_cache_gib: float = typer.Option(2, "--kv-cache-gib", help="CPU KV cache size in whole "
                                       "GiB (vLLM's CPU build takes no fractions)"),
    vllm_python: str = typer.Option(None, "--vllm-python", help="Python of the vLLM environment "
                                    "(default .venv-vllm/bin/python)"),
    log: Path = typer.Option(None, "--log", help="Server log file (default: in $TMPDIR)"),
    startup_timeout: float = typer.Option(900.0, "--startup-timeout"),
) -> None:
    """Run vLLM (prefix caching on) with kvnotes' connector: registered skills found at the start
    of a request salted `kvnotes-splice` are spliced instead of prefilled. Stops on Ctrl-C."""
    import kvnotes
    from kvnotes.serving.launch import LaunchConfig, prepare
    from kvnotes.serving.manifest import SPLICE_SALT

    config = LaunchConfig(model=model, dtype=dtype, block_size=block_size,
                          kv_cache_gib=kv_cache_gib, max_model_len=max_model_len, port=port,
                          skills=folder_option(skills, "--skills"), log_path=log,
                          startup_timeout=startup_timeout, vllm_python=vllm_python)
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
    with launch:
        typer.echo(f"serving {server.served_name} at {server.url}/v1 (pid {server.pid}); send "
                   f"prompts as token ids with cache_salt={SPLICE_SALT!r} to splice; Ctrl-C stops",
                   err=True)
        typer.echo(server.url)
        try:
            while server.proc is not None and server.proc.poll() is None:
                time.sleep(1.0)
        except KeyboardInterrupt:
            typer.echo("stopping the server", err=True)
            return
    raise ServingError(f"the vLLM server exited with code {server.proc.returncode if server.proc else '?'}"
                       f"; log: {server.log_path}\n{server.log_tail(20)}")


skills_app = typer.Typer(help="Skills a `kvnotes serve` server splices.", no_args_is_help=True)
app.add_typer(skills_app, name="skills")


@skills_app.command("add")
def skills_add(
    files: list[Path] = typer.Argument(..., help="Text files, one skill each (name: file stem)"),
    model: str = typer.Option("smollm2-135m", "--model"),
    skills: Path = typer.Option(..., "--skills", help="The folder given to `kvnotes serve`"),
    header: Path = typer.Option(None, "--header", help="Compile the skills behind this system "
                                "header (as `kvnotes serve --header`)"),
) -> None:
    """Compile skills with kvnotes and publish them (a running server picks them up)."""
    import kvnotes
    from kvnotes.serving.skills import ServingSkills

    texts = _skill_files(files)
    head = read_text_file(header, "--header") if header else None
    folder_option(skills, "--skills")
    lib = ServingSkills(skills, kvnotes.load(model))
    for name, text in texts:
        info = lib.add(text, name=name, after=head)
        typer.echo(f"{name}\t{len(info)} tokens\t{info.key}")


@skills_app.command("list")
def skills_list(
    model: str = typer.Option("smollm2-135m", "--model"),
    skills: Path = typer.Option(..., "--skills"),
) -> None:
    """The skills a server for this model would splice."""
    import kvnotes
    from kvnotes.serving.skills import ServingSkills

    for info in ServingSkills(skills, kvnotes.load(model)).entries():
        typer.echo(f"{info.name}\t{len(info)} tokens\tposition {info.origin}\t{info.key}")


