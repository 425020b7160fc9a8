"""Faults: a save or a model conversion SIGKILLed mid-way loses nothing and leaves no orphan.

A child process runs the real code up to a named pause point (``files.fault_point``, enabled
only by ``$KVNOTES_TEST_PAUSE``), signals that it is there, and is killed with SIGKILL. The
previous file or folder must still be whole, and the next write into that folder must sweep the
dead process's temporary. Model conversion stubs the slow dequantization (tiny files instead of
weights) but runs the real folder swap. Caches live under tmp_path, never the real home.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import kvnotes
from kvnotes.core import files
from kvnotes.core.models import convert_gguf
from kvnotes.core.tiny import ByteTokenizer, tiny_model

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL (POSIX)")


def tiny_engine() -> kvnotes.Engine:
    return kvnotes.Engine.from_model(tiny_model("llama", 256), ByteTokenizer(256))


def temporaries(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir()
            if p.name.startswith((files.TMP_PREFIX, files.OLD_PREFIX))]


def run_until_paused(script: str, point: str, tmp_path: Path, **env: str) -> None:
    """Start ``script`` in a child, wait until it reaches ``point``, SIGKILL it and reap it."""
    ready = tmp_path / f"ready-{point}"
    child_env = {**os.environ, "KVNOTES_TEST_PAUSE": point,
                 "KVNOTES_TEST_PAUSE_READY": str(ready), **env}
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], env=child_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None:
            raise AssertionError(f"child exited before {point}: {proc.stderr.read().decode()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"child never reached {point}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()  # reaped: a zombie would still look alive to the sweep
    assert proc.returncode == -signal.SIGKILL


SAVE_SCRIPT = """
    import kvnotes
    from kvnotes.core.tiny import ByteTokenizer, tiny_model
    engine = kvnotes.Engine.from_model(tiny_model("llama", 256), ByteTokenizer(256))
    engine.prefill("the new notes, much longer than the old ones " * 4).save({target!r})
"""


def test_save_killed_before_rename_keeps_the_old_file(tmp_path):
    engine = tiny_engine()
    target = tmp_path / "nb.safetensors"
    old = engine.prefill("the old notes")
    old.save(target)
    run_until_paused(SAVE_SCRIPT.format(target=str(target)), "write", tmp_path)
    orphans = temporaries(tmp_path)
    assert len(orphans) == 1 and orphans[0].stat().st_size > 0  # the killed save's data
    back = kvnotes.Notebook.load(target, engine)  # old file, whole and verified
    assert back.token_ids.tolist() == old.token_ids.tolist()
    engine.prefill("another").save(tmp_path / "other.safetensors")  # next save into the folder
    assert temporaries(tmp_path) == []


def test_a_failing_save_leaves_no_temporary(tmp_path, monkeypatch):
    engine = tiny_engine()
    target = tmp_path / "nb.safetensors"
    engine.prefill("kept").save(target)
    before = target.read_bytes()

    def disk_full(*a, **k):
        Path(a[1]).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files, "save_file", disk_full)
    with pytest.raises(OSError, match="No space"):
        engine.prefill("lost").save(target)
    assert target.read_bytes() == before and temporaries(tmp_path) == []


def test_live_temporaries_are_not_swept(tmp_path):
    mine = tmp_path / f"{files.temp_prefix()}abc.nb.safetensors"
    mine.write_bytes(b"in flight")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    theirs = tmp_path / f"{files.TMP_PREFIX}{files.HOST}.{dead}.abc.nb.safetensors"
    theirs.write_bytes(b"orphan")
    unrelated = tmp_path / "tmpq1w2.tmp"  # not ours: never touched
    unrelated.write_bytes(b"x")
    assert files.sweep(tmp_path) == [theirs]
    assert mine.exists() and unrelated.exists() and not theirs.exists()


# ---- model conversion ---------------------------------------------------------------------
CONVERT_SCRIPT = """
    import json
    from pathlib import Path
    from kvnotes.core import files, models

    class Saver:
        def __init__(self, tag):
            self.tag = tag
        def save_pretrained(self, folder):
            for i in range(3):
                (Path(folder) / f"{{self.tag}}-{{i}}.json").write_text(json.dumps({{"tag": self.tag}}))

    def stub(path, steps):  # the slow dequantization, stubbed
        tag = Path(path).read_bytes()[4:].decode()
        return Saver(tag), Saver(tag + "-tok")

    models._dequantize = stub
    if {no_exchange}:
        files._exchange = lambda a, b: False
    models.convert_gguf(Path({gguf!r}), cache_name="m")
"""


def convert_in_child(gguf: Path, point: str, tmp_path: Path, *, no_exchange: bool = False) -> None:
    script = CONVERT_SCRIPT.format(gguf=str(gguf), no_exchange=no_exchange)
    run_until_paused(script, point, tmp_path, KVNOTES_HOME=str(tmp_path / "home"))


def stub_dequantize(monkeypatch) -> None:
    class Saver:
        def __init__(self, tag: str) -> None:
            self.tag = tag

        def save_pretrained(self, folder: Path) -> None:
            for i in range(3):
                (Path(folder) / f"{self.tag}-{i}.json").write_text(json.dumps({"tag": self.tag}))

    def stub(path: Path, steps: object) -> tuple[Saver, Saver]:
        tag = Path(path).read_bytes()[4:].decode()
        return Saver(tag), Saver(tag + "-tok")

    monkeypatch.setattr("kvnotes.core.models._dequantize", stub)


def tags(folder: Path) -> set[str]:
    return {json.loads(p.read_text())["tag"] for p in folder.glob("*.json")
            if p.name != "kvnotes-source.json"}


@pytest.mark.parametrize("no_exchange,point", [(False, "staged_dir"), (True, "staged_dir"),
                                               (True, "staged_dir_aside")])
def test_conversion_killed_mid_way_keeps_the_previous_model(tmp_path, monkeypatch, no_exchange,
                                                            point):
    monkeypatch.setenv("KVNOTES_HOME", str(tmp_path / "home"))
    stub_dequantize(monkeypatch)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUFold")
    target = convert_gguf(gguf, cache_name="m")
    assert tags(target) == {"old", "old-tok"}
    time.sleep(1.1)  # the freshness stamp has one-second mtime resolution
    gguf.write_bytes(b"GGUFnew")
    convert_in_child(gguf, point, tmp_path, no_exchange=no_exchange)
    models = target.parent
    if point == "staged_dir_aside":
        # killed between the two renames: the old folder sits aside until the next sweep
        assert not target.exists() and len(temporaries(models)) == 2
        files.sweep(models)
        assert tags(target) == {"old", "old-tok"}  # moved back: nothing lost
    else:
        assert tags(target) == {"old", "old-tok"} and temporaries(models)
    again = convert_gguf(gguf, cache_name="m")  # the next conversion succeeds and cleans up
    assert tags(again) == {"new", "new-tok"} and temporaries(models) == []


def test_conversion_error_leaves_the_previous_model(tmp_path, monkeypatch):
    monkeypatch.setenv("KVNOTES_HOME", str(tmp_path / "home"))
    stub_dequantize(monkeypatch)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUFold")
    target = convert_gguf(gguf, cache_name="m")
    with pytest.raises(RuntimeError, match="midway"):
        with files.staged_dir(target) as tmp:
            (tmp / "half.json").write_text("{}")
            raise RuntimeError("midway")
    assert tags(target) == {"old", "old-tok"} and temporaries(target.parent) == []


def test_dotdot_gguf_cannot_touch_the_home(tmp_path, monkeypatch):
    """The issue's data-loss case: a file named ``..gguf`` used to replace all of models/."""
    home = tmp_path / "home"
    monkeypatch.setenv("KVNOTES_HOME", str(home))
    stub_dequantize(monkeypatch)
    keep = home / "models" / "smollm2-135m"
    keep.mkdir(parents=True)
    (keep / "weights.bin").write_text("precious")
    (home / "skills").mkdir()
    (home / "skills" / "entry").write_text("precious")
    for name in ("..gguf", "...gguf"):
        gguf = tmp_path / name
        gguf.write_bytes(b"GGUFx")
        folder = kvnotes.core.models.resolve(str(gguf))
        assert folder.parent == home / "models" and folder.name.startswith("model-")
    assert (keep / "weights.bin").read_text() == "precious"
    assert (home / "skills" / "entry").read_text() == "precious"
