"""Two processes share one skill library: damaged entries, races on delete and publish.

Both workers start at the same instant on a library whose entries were all damaged beforehand
(so both find the same bad entry and both try to remove it, the crash the issue reports), then
keep reading while damaging entries at random. Neither may raise; every entry left is whole;
no temporary survives. A reader never sees a partial entry because publishing is atomic.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import kvnotes
from kvnotes.core import files
from kvnotes.core.tiny import ByteTokenizer, tiny_model

TEXTS = [f"Skill {i}: refunds take {i + 2} days; exchanges need a receipt." for i in range(6)]

WORKER = """
    import os, random, sys, time
    from pathlib import Path
    import kvnotes
    from kvnotes.core.tiny import ByteTokenizer, tiny_model

    root, start, seed = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    texts = {texts!r}
    engine = kvnotes.Engine.from_model(tiny_model("llama", 256), ByteTokenizer(256))
    lib = kvnotes.SkillLibrary(root, engine)
    rng = random.Random(seed)
    while time.time() < start:
        time.sleep(0.001)
    for round_ in range(6):
        for text in texts:
            skill = lib.get(text, name="s")
            assert len(skill) == len(engine.encode(text)), "a partial or foreign skill was returned"
            if rng.random() < 0.3:  # damage an entry the other process may be reading
                path = lib.path_for(text)
                try:
                    path.write_bytes(os.urandom(64))
                except OSError:
                    pass
    print(lib.hits, lib.misses)
"""


def test_two_processes_share_a_damaged_library(tmp_path):
    root = tmp_path / "lib"
    engine = kvnotes.Engine.from_model(tiny_model("llama", 256), ByteTokenizer(256))
    lib = kvnotes.SkillLibrary(root, engine)
    for text in TEXTS:
        lib.get(text)
        lib.path_for(text).write_bytes(b"damaged")  # both workers find every entry damaged
    start = time.time() + 8.0  # both import torch first, then start together
    script = textwrap.dedent(WORKER.format(texts=TEXTS))
    procs = [subprocess.Popen([sys.executable, "-c", script, str(root), str(start), str(seed)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for seed in (1, 2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
        hits, misses = map(int, out.split())
        assert hits + misses == 6 * len(TEXTS) and misses >= 1
    folder = lib.root
    assert [p.name for p in folder.iterdir() if p.name.startswith(files.TMP_PREFIX)] == []
    final = kvnotes.SkillLibrary(root, engine)
    for text in TEXTS:  # every entry left is whole (or missing and compiled again)
        assert len(final.get(text)) == len(engine.encode(text))
    for path in folder.glob("*.safetensors"):
        kvnotes.Notebook.load(path, engine)


def test_a_reader_never_sees_a_half_published_entry(tmp_path, monkeypatch):
    """Publishing writes a temporary and renames it: while it is being written the entry is
    simply absent (a miss), never a truncated file."""
    engine = kvnotes.Engine.from_model(tiny_model("llama", 256), ByteTokenizer(256))
    lib = kvnotes.SkillLibrary(tmp_path / "lib", engine)
    seen: list[bool] = []
    real_save = files.save_file

    def observe(tensors, path, metadata=None):
        real_save(tensors, path, metadata=metadata)
        seen.append(lib.path_for(TEXTS[0]).exists())  # written, not yet renamed into place

    monkeypatch.setattr(files, "save_file", observe)
    lib.get(TEXTS[0])
    assert seen == [False] and lib.path_for(TEXTS[0]).is_file()
    assert os.listdir(lib.root) == [lib.path_for(TEXTS[0]).name]
    assert Path(lib.path_for(TEXTS[0])).stat().st_size > 0
