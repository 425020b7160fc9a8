"""``kvnotes skills``: the skills a ``kvnotes serve`` server splices: add, list, pin, forget."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from kvnotes.cli.app import app, folder_option, read_text_file
from kvnotes.core.errors import InvalidArgumentError, ServingError
from kvnotes.serving.json_types import JsonObject

if TYPE_CHECKING:
    from kvnotes.serving.library.registry import LearnedEntry


def skill_files(paths: list[Path] | None) -> list[tuple[str, str]]:
    """``(name, text)`` of each skill file (its name: the file's stem)."""
    return [(p.stem, read_text_file(p, "--skill")) for p in (paths or [])]


skills_app = typer.Typer(help="Skills a `kvnotes serve` server splices.", no_args_is_help=True)
app.add_typer(skills_app, name="skills")


@skills_app.command("add")
def skills_add(
    files: list[Path] = typer.Argument(..., help="Text files, one skill each (name: file stem)"),
    model: str = typer.Option("smollm2-135m", "--model"),
    skills: Path | None = typer.Option(None, "--skills", help="The folder given to `kvnotes "
                                       "serve` (compiled here by kvnotes' engine)"),
    server: str | None = typer.Option(None, "--server", metavar="URL", help="A running `kvnotes "
                                      "serve`: its vLLM compiles them (no model loaded here)"),
    api_key: str | None = typer.Option(None, "--api-key", envvar="KVNOTES_API_KEY", help="The "
                                       "server's operator key (with --server)"),
    header: Path | None = typer.Option(None, "--header", help="Compile the skills behind this system "
                                       "header (as `kvnotes serve --header`)"),
    after: str | None = typer.Option(None, "--after", help="Compile them as variants behind the "
                                     "header and this registered skill (the one that precedes "
                                     "them in requests)"),
    max_variants: int = typer.Option(4, "--max-variants", min=1, help="Variants kept per skill "
                                     "(the oldest are deleted)"),
) -> None:
    """Compile skills and publish them (a running server picks them up): by that server with
    --server, else here with kvnotes' engine into --skills."""
    texts = skill_files(files)
    head = read_text_file(header, "--header") if header else None
    if (server is None) == (skills is None):
        raise InvalidArgumentError("give --skills DIR (compiled here) or --server URL (compiled "
                                   "by that server), one of them")
    if server is not None:
        for row in register_on_server(server, texts, head, after, api_key):
            typer.echo(f"{row['name']}\t{row['tokens']} tokens\t{row['key']}"
                       + (f"\tafter {after}" if after else ""))
        return
    import kvnotes
    from kvnotes.serving.skills import ServingSkills

    assert skills is not None
    folder_option(skills, "--skills")
    lib = ServingSkills(skills, kvnotes.load(model), max_variants=max_variants)
    prefix: str | list[int] | None = head if after is None else lib.after_skill(after, header=head)
    for name, text in texts:
        info = lib.add(text, name=name, after=prefix)
        typer.echo(f"{name}\t{len(info)} tokens\t{info.key}"
                   + (f"\tafter {after}" if after else ""))


def register_on_server(url: str, texts: list[tuple[str, str]], header: str | None,
                       after: str | None, api_key: str | None) -> list[JsonObject]:
    """Register ``texts`` on the ``kvnotes serve`` at ``url`` (``POST /kvnotes/skills``): its
    rows (name, tokens, key) once the server has written them."""
    import httpx2

    from kvnotes.serving.front.skill_desk import SKILLS_PATH

    body = {"skills": [{"name": n, "text": t} for n, t in texts], "header": header,
            "after": after}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx2.post(url.rstrip("/") + SKILLS_PATH, json=body, headers=headers,
                           timeout=None)
    except httpx2.HTTPError as err:
        raise ServingError(f"cannot reach the server at {url}: {err}") from err
    if resp.status_code != 200:
        try:
            why = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            why = resp.text[:500]
        raise ServingError(f"the server at {url} refused the skills ({resp.status_code}): {why}")
    rows: list[JsonObject] = resp.json()["skills"]
    return rows


def folder_list(
    model: str = typer.Option("smollm2-135m", "--model"),
    skills: Path = typer.Option(..., "--skills"),
) -> None:
    """The skills a server for this model would splice: the registered ones, then the chunks
    and variants learned on sight (`kvnotes serve --learn`) with their tenant, what a variant
    is of and behind, its size and its use (hits, of them exactly placed)."""
    from kvnotes.serving.library.model_facts import ModelFacts
    from kvnotes.serving.library.registry import LearnedRegistry, registry_path
    from kvnotes.serving.skills import ServingSkills

    lib = ServingSkills(skills, ModelFacts.read(model))  # no weights, and no child: it exits
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


def folder_pin(
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


def folder_forget(
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
