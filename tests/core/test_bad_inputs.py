"""Bad inputs, one clear error each: the API, notebook files, the skill library, the CLI.

Every case asserts the error class and that the message names the problem (a substring), so a
case that starts failing deep inside torch, or silently succeeding, shows up here. Files are
damaged in two ways: bytes flipped (the checksum over header and tensors catches it) and a
malformed header written *with* a valid checksum (field validation catches it). Nothing here
touches the real $KVNOTES_HOME: model caches go to tmp_path.
"""

# ruff: noqa: E501  (case tables: one case per line reads best)
from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_tiny_engine
from safetensors.torch import save_file
from typer.testing import CliRunner

import kvnotes
from kvnotes import Document, Field
from kvnotes.cli import app
from kvnotes.cli.app import exit_code
from kvnotes.core import files, validate
from kvnotes.core.errors import (
    ArgumentTypeError,
    EmptyAnswerError,
    EmptyInputError,
    InvalidArgumentError,
    KvnotesError,
    NotebookFileError,
    NotebookMismatchError,
    PositionError,
    UnknownFieldError,
    UnknownModelError,
    UnknownNameError,
    UnsafePathError,
)
from kvnotes.ops.decisions import first_token_ids
from kvnotes.ops.quant import QuantizedNotebook, quantize
from kvnotes.ops.trace import TraceOptions

VOCAB_HUGE = 10**9
SURROGATE = "bad \ud800 text"


@dataclass
class Ctx:
    engine: kvnotes.Engine
    nb: kvnotes.Notebook
    doc: Document
    tmp: Path


@pytest.fixture(scope="module")
def ctx(tiny_llama, tmp_path_factory) -> Ctx:
    doc = Document(["Order status: ", Field("status", "pending"), ". Refund?"])
    return Ctx(tiny_llama, tiny_llama.prefill(doc), doc, tmp_path_factory.mktemp("bad"))


def _trace(c: Ctx, **kw: Any) -> Any:
    args = dict(field="status", new_value="paid", query=" Answer:", answers=("yes", "no"))
    args.update(kw)
    return kvnotes.trace(c.engine, c.doc, **args)


# (id, call, error class, substring the message must contain)
API_CASES: list[tuple[str, Callable[[Ctx], Any], type[Exception], str]] = [
    ("prefill-start-float", lambda c: c.engine.prefill("hi", start=1.5), ArgumentTypeError, "start must be an integer"),
    ("prefill-start-bool", lambda c: c.engine.prefill("hi", start=True), ArgumentTypeError, "start"),
    ("prefill-start-negative", lambda c: c.engine.prefill("hi", start=-1), PositionError, "start=-1"),
    ("prefill-start-huge", lambda c: c.engine.prefill("hi", start=2**40), PositionError, "start="),
    ("prefill-start-past-max", lambda c: c.engine.prefill("hi", start=10**6), PositionError, "maximum"),
    ("prefill-none", lambda c: c.engine.prefill(None), ArgumentTypeError, "x is None"),
    ("prefill-bytes", lambda c: c.engine.prefill(b"hello"), ArgumentTypeError, "got bytes"),
    ("prefill-int", lambda c: c.engine.prefill(42), ArgumentTypeError, "got int"),
    ("prefill-empty", lambda c: c.engine.prefill(""), EmptyInputError, "empty"),
    ("prefill-surrogate", lambda c: c.engine.prefill(SURROGATE), InvalidArgumentError, "unpaired surrogate"),
    ("prefill-id-negative", lambda c: c.engine.prefill([5, 6, -1]), InvalidArgumentError, "x[2]=-1"),
    ("prefill-id-too-large", lambda c: c.engine.prefill([VOCAB_HUGE]), InvalidArgumentError, "not a token id"),
    ("prefill-id-float", lambda c: c.engine.prefill([5, 2.5]), ArgumentTypeError, "x[1]"),
    ("prefill-float-tensor", lambda c: c.engine.prefill(torch.tensor([1.0, 2.0])), ArgumentTypeError, "integer tensor"),
    ("prefill-tensor-out-of-vocab", lambda c: c.engine.prefill(torch.tensor([1, VOCAB_HUGE])), InvalidArgumentError, "x[1]"),
    ("prefill-bos-str", lambda c: c.engine.prefill("hi", bos="yes"), ArgumentTypeError, "bos"),
    ("extend-not-notebook", lambda c: c.engine.extend("nb", "x"), ArgumentTypeError, "nb must be a kvnotes.Notebook"),
    ("extend-none", lambda c: c.engine.extend(c.nb, None), ArgumentTypeError, "x is None"),
    ("extend-id-out-of-vocab", lambda c: c.engine.extend(c.nb, [VOCAB_HUGE]), InvalidArgumentError, "not a token id"),
    ("compile-none", lambda c: c.engine.compile(None), ArgumentTypeError, "text must be a str"),
    ("compile-empty", lambda c: c.engine.compile(""), EmptyInputError, "text is empty"),
    ("compile-name-int", lambda c: c.engine.compile("x y", name=3), ArgumentTypeError, "name must be a str"),
    ("compile-surrogate", lambda c: c.engine.compile(SURROGATE), InvalidArgumentError, "surrogate"),
    ("compose-bare-string", lambda c: c.engine.compose("hello world"), ArgumentTypeError, "bare string"),
    ("compose-bare-document", lambda c: c.engine.compose(c.doc), ArgumentTypeError, "wrap a single part"),
    ("compose-bad-part", lambda c: c.engine.compose(["a", 3]), ArgumentTypeError, "compose part 1"),
    ("compose-none-part", lambda c: c.engine.compose([None]), ArgumentTypeError, "compose part 0"),
    ("compose-start-float", lambda c: c.engine.compose(["a"], start=0.5), ArgumentTypeError, "start"),
    ("compose-empty", lambda c: c.engine.compose([]), EmptyInputError, "at least one part"),
    ("compose-surrogate", lambda c: c.engine.compose(["ok", "\udfff"]), InvalidArgumentError, "compose part 1"),
    ("next-logits-not-notebook", lambda c: c.engine.next_logits(None), ArgumentTypeError, "nb must be"),
    ("next-logits-bad-id", lambda c: c.engine.next_logits(c.nb, [VOCAB_HUGE]), InvalidArgumentError, "query[0]"),
    ("next-logits-float-query", lambda c: c.engine.next_logits(c.nb, 3.0), ArgumentTypeError, "query"),
    ("generate-max-new-float", lambda c: c.engine.generate(c.nb, "q", max_new_tokens=2.5), ArgumentTypeError, "max_new_tokens"),
    ("generate-max-new-zero", lambda c: c.engine.generate(c.nb, "q", max_new_tokens=0), InvalidArgumentError, "max_new_tokens must be >= 1"),
    ("greedy-max-new-str", lambda c: c.engine.greedy(c.nb, "q", max_new_tokens="3"), ArgumentTypeError, "max_new_tokens"),
    ("greedy-negative-id", lambda c: c.engine.greedy(c.nb, [-3]), InvalidArgumentError, "query[0]=-3"),
    ("shift-float", lambda c: c.nb.shifted(0.5), ArgumentTypeError, "delta must be an integer"),
    ("shift-str", lambda c: c.nb.shifted("3"), ArgumentTypeError, "delta"),
    ("shift-huge", lambda c: c.nb.shifted(2**70), PositionError, "larger than any position"),
    ("shift-negative-past-zero", lambda c: c.nb.shifted(-10**6), PositionError, "negative position"),
    ("document-bare-string", lambda c: Document("hello world"), ArgumentTypeError, "bare string"),
    ("document-none", lambda c: Document(None), ArgumentTypeError, "Document parts"),
    ("document-int-part", lambda c: Document(["a", 3]), ArgumentTypeError, "Document part 1"),
    ("document-field-int", lambda c: Document([Field("s", 5)]), ArgumentTypeError, "field 's' value"),
    ("document-field-none", lambda c: Document([Field("s", None)]), ArgumentTypeError, "field 's' value"),
    ("document-duplicate-field", lambda c: Document([Field("a", "x"), Field("a", "y")]), InvalidArgumentError, "unique"),
    ("greedy-stop-bare-string", lambda c: c.engine.greedy(c.nb, "q", 3, stop="END"), ArgumentTypeError, "stop"),
    ("greedy-stop-int", lambda c: c.engine.greedy(c.nb, "q", 3, stop=5), ArgumentTypeError, "stop must be a list"),
    ("edit-chat-str", lambda c: kvnotes.edit(c.engine, c.nb, "status", "done", chat="no"), ArgumentTypeError, "chat must be True or False"),
    ("document-surrogate", lambda c: Document(["\ud800"]), InvalidArgumentError, "unpaired surrogate"),
    ("with-value-int", lambda c: c.doc.with_value("status", 3), ArgumentTypeError, "field 'status' value"),
    ("edit-new-value-int", lambda c: kvnotes.edit(c.engine, c.nb, "status", 3), ArgumentTypeError, "new_value"),
    ("edit-new-value-none", lambda c: kvnotes.edit(c.engine, c.nb, "status", None), ArgumentTypeError, "new_value"),
    ("edit-field-int", lambda c: kvnotes.edit(c.engine, c.nb, 3, "done"), ArgumentTypeError, "field"),
    ("edit-unknown-field", lambda c: kvnotes.edit(c.engine, c.nb, "colour", "red"), UnknownFieldError, "colour"),
    ("edit-k-float", lambda c: kvnotes.edit(c.engine, c.nb, "status", "done", strategy="repair", k=2.5), ArgumentTypeError, "k must be an integer"),
    ("edit-k-negative", lambda c: kvnotes.edit(c.engine, c.nb, "status", "done", strategy="repair", k=-1), InvalidArgumentError, "k must be >= 0"),
    ("edit-layer-out-of-range", lambda c: kvnotes.edit(c.engine, c.nb, "status", "done", layer=99), InvalidArgumentError, "layer must be <= 1"),
    ("edit-layer-negative", lambda c: kvnotes.edit(c.engine, c.nb, "status", "done", layer=-1), InvalidArgumentError, "layer must be >= 0"),
    ("edit-template-unknown-placeholder", lambda c: kvnotes.edit(c.engine, c.nb, "status", "done", template="Fix: {field} is {new}"), InvalidArgumentError, "unknown placeholder"),
    ("edit-template-broken-format", lambda c: kvnotes.edit(c.engine, c.nb, "status", "done", template="Fix {new} {"), InvalidArgumentError, "not a valid format"),
    ("trace-answer-none", lambda c: _trace(c, answers=("yes", None)), ArgumentTypeError, "answers[1]"),
    ("trace-answer-negative-id", lambda c: _trace(c, answers=("yes", -1)), InvalidArgumentError, "answers[1]"),
    ("trace-answer-huge-id", lambda c: _trace(c, answers=(VOCAB_HUGE, "no")), InvalidArgumentError, "answers[0]"),
    ("trace-answer-empty", lambda c: _trace(c, answers=("", "no")), EmptyAnswerError, "has no tokens"),
    ("decide-negative-answer-id", lambda c: first_token_ids(c.engine, ["yes", -1], after="Q:"), InvalidArgumentError, "answers[1]=-1"),
    ("decide-answers-bare-string", lambda c: first_token_ids(c.engine, "yes", after="Q:"), ArgumentTypeError, "bare string"),
    ("decide-answer-float", lambda c: first_token_ids(c.engine, ["yes", 2.0], after="Q:"), ArgumentTypeError, "answers[1]"),
    ("trace-answers-bare-string", lambda c: _trace(c, answers="yes"), ArgumentTypeError, "answers"),
    ("trace-new-value-int", lambda c: _trace(c, new_value=7), ArgumentTypeError, "new_value"),
    ("trace-query-none", lambda c: _trace(c, query=None), ArgumentTypeError, "query is None"),
    ("trace-batch-size-zero", lambda c: _trace(c, options=TraceOptions(batch_size=0)), InvalidArgumentError, "batch_size must be >= 1"),
    ("trace-doc-str", lambda c: kvnotes.trace(c.engine, "text", field="s", new_value="x", query="q", answers=("a", "b")), ArgumentTypeError, "doc must be"),
    ("keys-negative-layer", lambda c: c.nb.keys(-1), InvalidArgumentError, "layer must be >= 0"),
    ("values-layer-past-end", lambda c: c.nb.values(99), InvalidArgumentError, "layer must be <= 1"),
    ("slice-float", lambda c: c.nb.slice(1.5), ArgumentTypeError, "start must be an integer"),
    ("slice-out-of-range", lambda c: c.nb.slice(0, 10_000), InvalidArgumentError, "out of range"),
    ("shifted-flag-str", lambda c: c.nb.shifted(3, allow_approximate="yes"), ArgumentTypeError, "allow_approximate"),
    ("field-empty-name", lambda c: Field("", "x"), EmptyInputError, "field name is empty"),
    ("field-value-int", lambda c: Field("status", 3), ArgumentTypeError, "field 'status' value"),
    ("prefill-unknown-kind", lambda c: c.engine.prefill("hi", kind="note"), InvalidArgumentError, "kind must be one of"),
    ("load-without-engine", lambda c: kvnotes.Notebook.load(c.nb.save(c.tmp / "n.safetensors"), None), ArgumentTypeError, "needs the Engine"),
    ("quantize-unknown-axis", lambda c: quantize(c.nb, "row"), UnknownNameError, "valid axes: token, channel"),
]


@pytest.mark.parametrize("case", API_CASES, ids=[c[0] for c in API_CASES])
def test_api_bad_input(ctx, case):
    _, call, error, words = case
    with pytest.raises(error) as info:
        call(ctx)
    assert isinstance(info.value, KvnotesError)
    assert words in str(info.value)


# ---- kvnotes.load: checks come before any weights load -------------------------------------
@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KVNOTES_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def no_weights(monkeypatch):
    """Fail the test if model resolution or loading starts (the argument check came too late)."""
    def boom(*a, **k):
        raise AssertionError("weights were about to load before the argument check")
    monkeypatch.setattr("kvnotes.core.models.resolve", boom)
    monkeypatch.setattr("kvnotes.core.models.load_folder", boom)


def _junk_gguf(tmp: Path, name: str = "junk.gguf") -> Path:
    path = tmp / name
    path.write_bytes(os.urandom(4096))
    return path


LOAD_CASES: list[tuple[str, Callable[[Path], Any], type[Exception], str]] = [
    ("dtype-unknown", lambda t: kvnotes.load("smollm2-135m", dtype="float8"), InvalidArgumentError, "dtype must be one of"),
    ("dtype-int", lambda t: kvnotes.load("smollm2-135m", dtype=torch.int64), InvalidArgumentError, "dtype"),
    ("device-garbage", lambda t: kvnotes.load("smollm2-135m", device="warp9"), InvalidArgumentError, "not a torch device"),
    ("device-missing-gpu", lambda t: kvnotes.load("smollm2-135m", device="cuda:97"), InvalidArgumentError, "not available"),
    ("device-int-type", lambda t: kvnotes.load("smollm2-135m", device=None), ArgumentTypeError, "device must be"),
]


@pytest.mark.parametrize("case", LOAD_CASES, ids=[c[0] for c in LOAD_CASES])
def test_load_checks_arguments_before_weights(no_weights, tmp_path, case):
    _, call, error, words = case
    with pytest.raises(error, match=None) as info:
        call(tmp_path)
    assert words in str(info.value)


MODEL_CASES: list[tuple[str, Callable[[Path], Any], type[Exception], str]] = [
    ("random-bytes-gguf", lambda t: kvnotes.load(str(_junk_gguf(t))), UnknownModelError, "not a GGUF file"),
    ("dotdot-gguf-random", lambda t: kvnotes.load(str(_junk_gguf(t, "..gguf"))), UnknownModelError, "not a GGUF file"),
    ("missing-gguf", lambda t: kvnotes.load(str(t / "none.gguf")), UnknownModelError, "no GGUF file"),
    ("empty-name", lambda t: kvnotes.load(""), UnknownModelError, "empty model name"),
    ("none-name", lambda t: kvnotes.load(None), ArgumentTypeError, "model must be a str"),
    ("folder-without-config", lambda t: kvnotes.load(str(t)), UnknownModelError, "no config.json"),
    ("text-file", lambda t: (t / "notes.txt").write_text("x") and kvnotes.load(str(t / "notes.txt")), UnknownModelError, "unknown model"),
    ("unsafe-cache-name", lambda t: kvnotes.core.models.convert_gguf(_junk_gguf(t), cache_name=".."), UnknownModelError, "unsafe model cache name"),
]


@pytest.mark.parametrize("case", MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def test_model_bad_input(home, tmp_path, case):
    _, call, error, words = case
    with pytest.raises(error) as info:
        call(tmp_path)
    assert words in str(info.value)
    assert not (home / "models").exists() or not any((home / "models").iterdir())


def test_gguf_names_never_become_paths(tmp_path):
    from kvnotes.core.models import gguf_cache_name

    for name in ("..gguf", "...gguf", ".gguf", "a b/..gguf".replace("/", "_"), "évil name.gguf"):
        path = tmp_path / name
        path.write_bytes(b"GGUF" + os.urandom(64))
        slug = gguf_cache_name(path)
        assert files.check_plain_child(tmp_path / slug).name == slug
        assert slug not in (".", "..") and "/" not in slug and not slug.startswith(".")
    one, two = tmp_path / "x1", tmp_path / "x2"
    one.mkdir(), two.mkdir()
    (one / "m.gguf").write_bytes(b"GGUF1"), (two / "m.gguf").write_bytes(b"GGUF2")
    assert gguf_cache_name(one / "m.gguf") != gguf_cache_name(two / "m.gguf")  # content decides


# ---- the folder helper and file targets ---------------------------------------------------
def _symlink(t: Path) -> Path:
    (t / "real").mkdir(exist_ok=True)
    link = t / "link"
    if not link.exists():
        link.symlink_to(t / "real")
    return link


def _enter(target: Path | str) -> None:
    with files.staged_dir(target):
        pass


PATH_CASES: list[tuple[str, Callable[[Path], Any], type[Exception], str]] = [
    ("staged-dotdot", lambda t: _enter(t / "models" / ".."), UnsafePathError, "not a plain child"),
    ("staged-dot-str", lambda t: _enter(str(t / "models") + "/."), UnsafePathError, "not a plain child"),
    ("staged-dotdot-str", lambda t: _enter(str(t / "models") + "/../"), UnsafePathError, "not a plain child"),
    ("staged-file", lambda t: (t / "f").write_text("x") and _enter(t / "f"), UnsafePathError, "it is a file"),
    ("staged-symlink", lambda t: _enter(_symlink(t)), UnsafePathError, "symbolic link"),
    ("staged-parent-file", lambda t: (t / "pf").write_text("x") and _enter(t / "pf" / "child"), UnsafePathError, "is a file, not a folder"),
]


@pytest.mark.parametrize("case", PATH_CASES, ids=[c[0] for c in PATH_CASES])
def test_unsafe_folder_targets(tmp_path, case):
    _, call, error, words = case
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(error) as info:
        call(tmp_path)
    assert words in str(info.value)
    assert (tmp_path / "real").exists() or "staged-symlink" != case[0]
    after = sorted(p.name for p in tmp_path.rglob("*") if not p.name.startswith(files.TMP_PREFIX))
    assert set(before) <= set(after)  # nothing deleted


@pytest.mark.parametrize("bad", [None, "", 3, "nb\x00.safetensors"])
def test_save_and_load_need_a_file_path(ctx, bad):
    with pytest.raises(UnsafePathError, match="must be a non-empty file path"):
        ctx.nb.save(bad)
    with pytest.raises(UnsafePathError, match="must be a non-empty file path"):
        kvnotes.Notebook.load(bad, ctx.engine)


def test_model_name_with_nul_is_refused():
    with pytest.raises(UnknownModelError, match="NUL character"):
        kvnotes.load("smollm2\x00-135m")


def test_save_to_a_folder_or_under_a_file(ctx, tmp_path):
    with pytest.raises(UnsafePathError, match="it is a folder"):
        ctx.nb.save(tmp_path)
    (tmp_path / "plain").write_text("x")
    with pytest.raises(UnsafePathError, match="is a file, not a folder"):
        ctx.nb.save(tmp_path / "plain" / "nb.safetensors")


# ---- notebook files -----------------------------------------------------------------------
def _saved(c: Ctx, name: str = "nb.safetensors", q: bool = False) -> Path:
    path = c.tmp / name
    (quantize(c.nb) if q else c.nb).save(path)
    return path


def _header_and_tensors(path: Path) -> tuple[dict, dict]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["kvnotes"]), {k: f.get_tensor(k) for k in f.keys()}


def _rewrite(c: Ctx, q: bool, edit: Callable[[dict, dict], None], name: str) -> Path:
    """A copy of a saved notebook with ``edit`` applied to its header/tensors, checksum *valid*."""
    header, tensors = _header_and_tensors(_saved(c, "src-" + name, q))
    edit(header, tensors)
    header.pop("checksum"), header.pop("container")
    return files.write(c.tmp / name, tensors, header)


def _flip(path: Path, old: bytes, new: bytes) -> Path:
    data = path.read_bytes()
    assert old in data
    path.write_bytes(data.replace(old, new, 1))
    return path


def _old_format(c: Ctx) -> Path:
    header, tensors = _header_and_tensors(_saved(c, "old-src.safetensors"))
    header.pop("container")
    header["checksum"] = files.checksum(tensors)  # v1: tensors only
    path = c.tmp / "old.safetensors"
    save_file(tensors, str(path), metadata={"kvnotes": json.dumps(header)})
    return path


def _header_list(c: Ctx) -> Path:
    path = c.tmp / "list.safetensors"
    save_file({"x": torch.zeros(1)}, str(path), metadata={"kvnotes": "[1, 2]"})
    return path


def _truncated(c: Ctx) -> Path:
    path = _saved(c, "trunc.safetensors")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def _set(key: str, value: Any) -> Callable[[dict, dict], None]:
    def edit(h: dict, t: dict) -> None:
        h[key] = value
    return edit


def _span(value: Any) -> Callable[[dict, dict], None]:
    def edit(h: dict, t: dict) -> None:
        h["spans"][0] = value
    return edit


def _tensor(name: str, value: Any) -> Callable[[dict, dict], None]:
    def edit(h: dict, t: dict) -> None:
        if value is None:
            del t[name]
        else:
            t[name] = value(t[name])
    return edit


def _fp(key: str, value: Any) -> Callable[[dict, dict], None]:
    def edit(h: dict, t: dict) -> None:
        if value is None:
            del h["fingerprint"][key]
        else:
            h["fingerprint"][key] = value
    return edit


def _meta_doc(h: dict, t: dict) -> None:
    h["meta"]["document"]["parts"].append(["field", 3])


NB = Callable[[Ctx], Path]
FILE_CASES: list[tuple[str, NB, type[Exception], str]] = [
    ("missing", lambda c: c.tmp / "absent.safetensors", NotebookFileError, "no notebook file"),
    ("folder", lambda c: c.tmp, NotebookFileError, "it is a folder"),
    ("random-bytes", lambda c: (c.tmp / "rnd").write_bytes(os.urandom(300)) and c.tmp / "rnd", NotebookFileError, "not a readable kvnotes notebook"),
    ("truncated", _truncated, NotebookFileError, "truncated"),
    ("not-kvnotes", lambda c: save_file({"x": torch.zeros(2)}, str(c.tmp / "plain.st")) or c.tmp / "plain.st", NotebookFileError, "not a kvnotes notebook"),
    ("header-not-object", _header_list, NotebookFileError, "not a JSON object"),
    ("span-name-flipped", lambda c: _flip(_saved(c, "flip.st"), b"status", b"statuz"), NotebookFileError, "checksum mismatch"),
    ("tensor-byte-flipped", lambda c: _flip(_saved(c, "tflip.st"), b"token_ids", b"token_idz"), NotebookFileError, "checksum mismatch"),
    ("old-format", _old_format, NotebookFileError, "older kvnotes"),
    ("layout-3", lambda c: _rewrite(c, False, _set("container_note", 1), "c3.st") and _flip(c.tmp / "c3.st", b'container\\": 2', b'container\\": 3'), NotebookFileError, "unsupported kvnotes file layout 3"),
    ("length-str", lambda c: _rewrite(c, False, _set("length", "9"), "len.st"), NotebookFileError, "length must be an integer"),
    ("length-negative", lambda c: _rewrite(c, False, _set("length", -1), "lenneg.st"), NotebookFileError, "length must be"),
    ("origin-float", lambda c: _rewrite(c, False, _set("origin", 1.5), "orig.st"), NotebookFileError, "origin must be"),
    ("num-layers-wrong", lambda c: _rewrite(c, False, _set("num_layers", 7), "nl.st"), NotebookFileError, "num_layers 7"),
    ("scheme-int", lambda c: _rewrite(c, False, _set("scheme", 3), "sch.st"), NotebookFileError, "scheme must be"),
    ("spans-not-list", lambda c: _rewrite(c, False, _set("spans", {"a": 1}), "spl.st"), NotebookFileError, "spans must be a list"),
    ("span-past-end", lambda c: _rewrite(c, False, _span(["text", "text", 0, 999]), "spe.st"), NotebookFileError, "span 0"),
    ("span-bad-kind", lambda c: _rewrite(c, False, _span(["x", "bogus", 0, 1]), "spk.st"), NotebookFileError, "span 0"),
    ("span-reversed", lambda c: _rewrite(c, False, _span(["x", "text", 3, 1]), "spr.st"), NotebookFileError, "span 0"),
    ("meta-list", lambda c: _rewrite(c, False, _set("meta", [1]), "meta.st"), NotebookFileError, "meta must be a JSON object"),
    ("meta-document-bad-part", lambda c: _rewrite(c, False, _meta_doc, "md.st"), NotebookFileError, "meta.document part"),
    ("fingerprint-missing-key", lambda c: _rewrite(c, False, _fp("weights_sha", None), "fp.st"), NotebookFileError, "fingerprint"),
    ("fingerprint-layers-str", lambda c: _rewrite(c, False, _fp("num_layers", "2"), "fp2.st"), NotebookFileError, "num_layers"),
    ("tensor-missing", lambda c: _rewrite(c, False, _tensor("layers.1.values", None), "tm.st"), NotebookFileError, "tensors do not match"),
    ("token-ids-float", lambda c: _rewrite(c, False, _tensor("token_ids", lambda t: t.float()), "tf.st"), NotebookFileError, "token_ids must be int64"),
    ("positions-short", lambda c: _rewrite(c, False, _tensor("positions", lambda t: t[:-1]), "ps.st"), NotebookFileError, "positions must be int64"),
    ("positions-negative", lambda c: _rewrite(c, False, _tensor("positions", lambda t: t - 100), "pn.st"), NotebookFileError, "positions must be >= 0"),
    ("keys-int8", lambda c: _rewrite(c, False, _tensor("layers.0.keys", lambda t: t.to(torch.int8)), "ki.st"), NotebookFileError, "layers.0.keys"),
    ("keys-wrong-length", lambda c: _rewrite(c, False, _tensor("layers.0.keys", lambda t: t[..., :2, :]), "kl.st"), NotebookFileError, "layers.0.keys"),
]


@pytest.mark.parametrize("case", FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_notebook_file_bad(ctx, case):
    _, make, error, words = case
    path = make(ctx)
    with pytest.raises(error) as info:
        kvnotes.Notebook.load(path, ctx.engine)
    assert words in str(info.value), str(info.value)


Q_CASES: list[tuple[str, NB, type[Exception], str]] = [
    ("q-dtype-flipped", lambda c: _flip(_saved(c, "qd.st", q=True), b"float32", b"float16"), NotebookFileError, "checksum mismatch"),
    ("q-dtype-unknown", lambda c: _rewrite(c, True, _set("dtype", "int64"), "qdu.st"), NotebookFileError, "dtype must be one of"),
    ("q-dtype-attr", lambda c: _rewrite(c, True, _set("dtype", "Tensor"), "qda.st"), NotebookFileError, "dtype must be one of"),
    ("q-axis", lambda c: _rewrite(c, True, _set("axis", "diagonal"), "qa.st"), NotebookFileError, "axis must be one of"),
    ("q-scale-int", lambda c: _rewrite(c, True, _tensor("layers.0.keys.scale", lambda t: t.to(torch.int8)), "qs.st"), NotebookFileError, "layers.0.keys.scale"),
    ("q-full-precision-file", lambda c: _saved(c, "fp.st"), NotebookFileError, "unsupported format"),
]


@pytest.mark.parametrize("case", Q_CASES, ids=[c[0] for c in Q_CASES])
def test_quantized_file_bad(ctx, case):
    _, make, error, words = case
    path = make(ctx)
    with pytest.raises(error) as info:
        QuantizedNotebook.load(path, ctx.engine)
    assert words in str(info.value), str(info.value)


def test_notebook_of_another_model_is_a_mismatch(ctx, tokenizer):
    other = make_tiny_engine("llama", tokenizer, seed=1)
    with pytest.raises(NotebookMismatchError, match="different model"):
        kvnotes.Notebook.load(_saved(ctx, "mine.st"), other)


def test_the_header_checksum_catches_what_the_tensor_checksum_missed(ctx):
    """The issue's two silent cases: a renamed span, and a float16 header on float32 notes."""
    path = _saved(ctx, "ok.st")
    assert kvnotes.Notebook.load(path, ctx.engine).fields == ["status"]
    for make in (lambda: _flip(_saved(ctx, "a.st"), b"status", b"statuz"),
                 lambda: _flip(_saved(ctx, "b.st", q=True), b"float32", b"float16")):
        with pytest.raises(NotebookFileError, match="checksum mismatch"):
            (QuantizedNotebook if "b.st" in str(p := make()) else kvnotes.Notebook).load(p, ctx.engine)


# ---- the skill library --------------------------------------------------------------------
LIB_CASES: list[tuple[str, Callable[[Ctx], Any], type[Exception], str]] = [
    ("root-is-file", lambda c: (c.tmp / "libfile").write_text("x") and kvnotes.SkillLibrary(c.tmp / "libfile", c.engine), UnsafePathError, "is a file"),
    ("engine-none", lambda c: kvnotes.SkillLibrary(c.tmp / "l", None), ArgumentTypeError, "engine must be a kvnotes.Engine"),
    ("root-none", lambda c: kvnotes.SkillLibrary(None, c.engine), InvalidArgumentError, "root must be a folder path"),
    ("quantize-int4", lambda c: kvnotes.SkillLibrary(c.tmp / "l", c.engine, quantize="int4"), InvalidArgumentError, "quantize must be"),
    ("anchor-left", lambda c: kvnotes.SkillLibrary(c.tmp / "l", c.engine, anchor="left"), InvalidArgumentError, "anchor must be one of"),
    ("get-none", lambda c: kvnotes.SkillLibrary(c.tmp / "l", c.engine).get(None), ArgumentTypeError, "text must be a str"),
    ("get-empty", lambda c: kvnotes.SkillLibrary(c.tmp / "l", c.engine).get(""), EmptyInputError, "text is empty"),
    ("get-name-int", lambda c: kvnotes.SkillLibrary(c.tmp / "l", c.engine).get("a b", name=4), ArgumentTypeError, "name must be a str"),
    ("contains-surrogate", lambda c: SURROGATE in kvnotes.SkillLibrary(c.tmp / "l", c.engine), InvalidArgumentError, "surrogate"),
]


@pytest.mark.parametrize("case", LIB_CASES, ids=[c[0] for c in LIB_CASES])
def test_library_bad_input(ctx, case):
    _, call, error, words = case
    with pytest.raises(error) as info:
        call(ctx)
    assert words in str(info.value)


@pytest.mark.parametrize("damage", ["truncate", "flip-header", "garbage", "foreign-model", "empty"])
def test_damaged_library_entry_is_a_miss(ctx, tokenizer, tmp_path, damage):
    lib = kvnotes.SkillLibrary(tmp_path / "lib", ctx.engine)
    text = "Refunds take five days."
    first = lib.get(text, name="refunds")
    path = lib.path_for(text)
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:100])
    elif damage == "flip-header":
        _flip(path, b"skill", b"skilz")
    elif damage == "garbage":
        path.write_bytes(os.urandom(500))
    elif damage == "empty":
        path.write_bytes(b"")
    else:  # a valid entry of another model planted under this model's key
        other = make_tiny_engine("llama", tokenizer, seed=2)
        other.compile(text).save(path)
    again = kvnotes.SkillLibrary(tmp_path / "lib", ctx.engine)
    skill = again.get(text, name="refunds")
    assert (again.hits, again.misses) == (0, 1)
    assert torch.equal(skill.keys(0), first.keys(0))
    assert kvnotes.Notebook.load(path, ctx.engine).fields == []  # republished, whole
    third = kvnotes.SkillLibrary(tmp_path / "lib", ctx.engine)
    third.get(text)
    assert (third.hits, third.misses) == (1, 0)


def test_library_entry_vanishing_mid_read_is_a_miss(ctx, tmp_path, monkeypatch):
    lib = kvnotes.SkillLibrary(tmp_path / "lib", ctx.engine)
    lib.get("A skill text.")
    real_load = kvnotes.Notebook.load

    def deleted_by_a_peer(path, engine):
        Path(path).unlink()  # another process removed it after our stat
        return real_load(path, engine)

    monkeypatch.setattr(kvnotes.Notebook, "load", staticmethod(deleted_by_a_peer))
    again = kvnotes.SkillLibrary(tmp_path / "lib", ctx.engine)
    assert len(again.get("A skill text.")) > 0 and again.misses == 1


def test_unwritable_library_still_returns_the_skill(ctx, tmp_path, monkeypatch):
    lib = kvnotes.SkillLibrary(tmp_path / "lib", ctx.engine)

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files, "save_file", full_disk)
    with pytest.warns(RuntimeWarning, match="not writable"):
        skill = lib.get("Some skill.")
    assert len(skill) > 0
    assert not [p for p in (tmp_path / "lib").rglob("*") if p.is_file()]  # no temp left


# ---- the command line ---------------------------------------------------------------------
runner = CliRunner()


def _binary(t: Path) -> Path:
    p = t / "skill.bin"
    p.write_bytes(b"\x00\xff\xfe\x80" * 10)
    return p


def _compose(model: str, skill: Path, *extra: str) -> list[str]:
    return ["compose", "--model", model, "--skill", str(skill), "--context", "c", "--query", "q",
            *extra]


def _file(t: Path, name: str = "existing") -> Path:
    p = t / name
    p.write_text("x")
    return p


CLI_CASES: list[tuple[str, Callable[[Path, Path], list[str]], int, str]] = [
    ("skill-binary", lambda t, m: _compose(str(m), _binary(t)), 2, "is not UTF-8 text"),
    ("skill-folder", lambda t, m: _compose(str(m), t), 2, "no skill file"),
    ("skill-missing", lambda t, m: _compose(str(m), t / "nope.txt"), 2, "no skill file"),
    ("library-is-file", lambda t, m: _compose(str(m), _file(t, "s.txt"), "--library", str(_file(t))), 2, "is a file"),
    ("demo-out-is-file", lambda t, m: ["demo", "--model", str(m), "--out", str(_file(t))], 2, "--out"),
    ("edit-out-is-file", lambda t, m: ["edit", "--model", str(m), "--out", str(_file(t))], 2, "--out"),
    ("doctor-random-gguf", lambda t, m: ["doctor", "--model", str(_junk_gguf(t))], 2, "not a GGUF file"),
    ("doctor-both-options", lambda t, m: ["doctor", "--model", "x", "--tiny", "llama"], 2, "at most one of"),
    ("unknown-model", lambda t, m: _compose("no-such-model", _file(t, "s.txt")), 2, "unknown model"),
    ("unknown-command", lambda t, m: ["frobnicate"], 2, "No such command"),
    ("bad-int-option", lambda t, m: ["agent", "--model", "x", "--episode", "zero"], 2, "--episode"),
]


@pytest.mark.parametrize("case", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_one_line_no_traceback(tiny_folder, tmp_path, home, case):
    _, make, code, words = case
    result = runner.invoke(app, make(tmp_path, tiny_folder))
    assert result.exit_code == code, result.output
    err = result.stderr.strip().splitlines()[-1]  # after any progress bar of the model load
    assert err.startswith("error: "), result.stderr
    assert words in err and "Traceback" not in result.output


def test_cli_exit_codes_split_usage_from_runtime():
    assert exit_code(InvalidArgumentError("x")) == 2 and exit_code(UnknownModelError("x")) == 2
    assert exit_code(NotebookFileError("x")) == 1 and exit_code(NotebookMismatchError("x")) == 1
    assert exit_code(OSError(5, "I/O error")) == 1 and exit_code(RuntimeError("bug")) == 1


def test_validate_helpers_reject_without_truncating():
    assert validate.integer(torch.tensor(3), "n") == 3
    with pytest.raises(ArgumentTypeError, match="n must be an integer, got 3.0"):
        validate.integer(3.0, "n")
    assert struct.calcsize("q") == 8 and validate.MAX_POSITION < 2**63
