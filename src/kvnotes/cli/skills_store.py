"""``kvnotes skills list/pin/forget`` on a folder (``--skills``) or a shared store (``--store``).

With ``--skills DIR`` the commands are the folder's (:mod:`kvnotes.cli.skills`: registered
skills grouped with their variants, the learned entries with their registry rows). With
``--store URL`` they work on the store, every model in it at once, without loading one: each
entry's model fingerprint id, tenant, size, use and whether it is pinned, evictable (learned)
or registered (the operator's: never evicted, never forgotten from here).

The folder's side of each command is :mod:`kvnotes.cli.skills`' (``folder_list``,
``folder_pin``, ``folder_forget``); ``skills add`` is registered there.
"""

from __future__ import annotations

import time
from pathlib import Path

import typer

from kvnotes.cli.skills import folder_forget, folder_list, folder_pin, skills_app
from kvnotes.cli.store_options import open_store, store_option, store_password_file_option
from kvnotes.core.errors import InvalidArgumentError
from kvnotes.serving.store import EntryInfo, Store


def _row(info: EntryInfo) -> str:
    used = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.last_used))
            if info.last_used else "never")
    state = ("pinned" if info.pinned else "evictable") if info.learned else "registered"
    return (f"{info.model}\t{info.name}\t{info.kind}\ttenant {info.tenant or '-'}\t"
            f"{info.tokens} tokens\t{info.bytes} bytes\t{info.hits} hits\tlast used {used}\t"
            f"{state}\t{info.key}")


def resolve(store: Store, key: str) -> EntryInfo:
    """The entry whose key is ``key`` or starts with it (6+ characters), in any model and
    tenant; :class:`InvalidArgumentError` naming what is wrong otherwise."""
    if len(key) < 6 or not key.replace("-", "").replace("_", "").isalnum():
        raise InvalidArgumentError(f"{key!r} is not an entry key: give the key shown by "
                                   "`kvnotes skills list --store URL` (or its first 6+ characters)")
    found = [i for i in store.list(every=True) if i.key.startswith(key)]
    if len(found) > 1:
        raise InvalidArgumentError(f"{key!r} names {len(found)} entries: give more of the key")
    if not found:
        raise InvalidArgumentError(f"no entry {key!r} in {store.url} (see `kvnotes skills list "
                                   "--store URL`)")
    if not found[0].learned:
        raise InvalidArgumentError(f"{key!r} is a registered skill ({found[0].name}), not a "
                                   "learned one: registered skills are never evicted")
    return found[0]


@skills_app.command("list")
def skills_list(
    model: str = typer.Option("smollm2-135m", "--model", help="With --skills: the model whose "
                              "folder to list"),
    skills: Path | None = typer.Option(None, "--skills", help="The folder given to `kvnotes serve`"),
    store: str | None = store_option(),
    store_password_file: Path | None = store_password_file_option(),
    tenant: str | None = typer.Option(None, "--tenant", help="With --store: only what this "
                                      "tenant's requests may splice (its own and the shared)"),
) -> None:
    """The skills a server would splice: with --skills, this model's folder (registered skills
    with their variants, then the learned chunks); with --store, every entry of every model in
    the store, least recently used first."""
    if store is None:
        if tenant is not None:
            raise InvalidArgumentError("--tenant lists a --store URL")
        folder_list(model=model, skills=_need(skills))
        return
    st = open_store(store, store_password_file)
    try:
        for info in st.list(tenant=tenant, every=tenant is None):
            typer.echo(_row(info))
    finally:
        st.close()


def _need(skills: Path | None) -> Path:
    if skills is None:
        raise InvalidArgumentError("give --skills DIR (the folder given to `kvnotes serve`) or "
                                   "--store URL")
    return skills


@skills_app.command("pin")
def skills_pin(
    key: str = typer.Argument(..., help="A learned entry's key (or its first 6+ characters)"),
    skills: Path | None = typer.Option(None, "--skills", help="The folder given to `kvnotes serve`"),
    store: str | None = store_option(),
    store_password_file: Path | None = store_password_file_option(),
    unpin: bool = typer.Option(False, "--unpin", help="Make it evictable again"),
) -> None:
    """Keep a learned chunk: a pinned entry is never evicted (by the cap or a quota)."""
    if store is None:
        folder_pin(key=key, skills=_need(skills), unpin=unpin)
        return
    st = open_store(store, store_password_file)
    try:
        info = resolve(st, key)
        if not st.pin(info.model, info.key, not unpin):
            raise InvalidArgumentError(f"entry {info.key} is gone from {st.url}")
    finally:
        st.close()
    typer.echo(f"{info.key}\t{'evictable' if unpin else 'pinned'}")


@skills_app.command("forget")
def skills_forget(
    key: str = typer.Argument(..., help="A learned entry's key (or its first 6+ characters)"),
    skills: Path | None = typer.Option(None, "--skills", help="The folder given to `kvnotes serve`"),
    store: str | None = store_option(),
    store_password_file: Path | None = store_password_file_option(),
) -> None:
    """Drop a learned chunk: from the folder, or from the store (every host's local copy is
    deleted at its mirror's next poll; a request already planned with it recomputes those
    tokens)."""
    if store is None:
        folder_forget(key=key, skills=_need(skills))
        return
    st = open_store(store, store_password_file)
    try:
        info = resolve(st, key)
        if not st.forget(info.model, info.key):
            raise InvalidArgumentError(f"entry {info.key} is gone from {st.url}")
    finally:
        st.close()
    typer.echo(f"{info.key}\tforgotten")
