"""Several servers, one skills folder: two reader processes (each what a server runs, the
scheduler's index and the worker's entry reads) follow the folder while a third process
publishes skills into it over and over, replaces them, and deletes one.

Each reader must pick every new skill up, must never index or load a partial entry (a load
either returns the checksummed tensors of a complete entry or is refused as missing), and must
drop the deleted skill. The publisher runs under another host name than this test: it sweeps
its own host's dead temporaries and leaves this host's alone, as a writer on one machine must
leave another machine's temporaries in a shared folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import make_tiny_engine

from kvnotes.core import files
from kvnotes.serving.skills import ServingSkills

SRC = Path(__file__).resolve().parents[2] / "src"
PUBLISHER_HOST = "publisher-host"
SKILLS = 5
DELETED = 1  # the index of the skill the publisher deletes part-way

READER = textwrap.dedent("""
    import json, logging, sys, time
    from pathlib import Path
    import torch
    from kvnotes.serving.library.piece_store import PieceStore
    from kvnotes.serving.vllm.kv_writer import KvWriter, PieceUnavailable, WorkerShare

    folder, ready, done, out, status = (Path(a) for a in sys.argv[1:6])
    warnings = []

    class Count(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    log = logging.getLogger("vllm.kvnotes")
    log.addHandler(Count())
    log.setLevel(logging.INFO)
    store = PieceStore(folder, rescan_s=0.0)
    m = store.manifest
    share = WorkerShare(torch.device("cpu"), torch.float32, range(m.num_kv_heads),
                        tuple(range(m.num_layers)))
    writer = KvWriter(folder, m, share, max_bytes=0)  # nothing kept: every load reads the file
    seen, loaded, missing, bad = set(), {}, 0, []

    def sweep_once():
        global missing
        store.refresh()
        for key in list(store._paths):
            piece = store.index.get(key)
            if piece is None:
                continue
            seen.add(key)
            try:
                keys, values = writer.piece(None, piece)
            except PieceUnavailable as err:
                text = str(err)
                if "gone from" in text or "no skill file at" in text:
                    missing += 1
                else:
                    bad.append(text)
                continue
            if keys.shape[1] != len(piece.token_ids) or keys.shape != values.shape:
                bad.append(f"{key}: shape {tuple(keys.shape)} for {len(piece.token_ids)} tokens")
            loaded[key] = loaded.get(key, 0) + 1

    ready.write_text("ready")
    while not done.exists():
        sweep_once()
        status.write_text(json.dumps(sorted(seen)))  # (not atomic: the publisher retries)
        time.sleep(0.02)  # leave the publisher some of the machine
    time.sleep(0.05)
    sweep_once()  # after the last publish: everything must be there
    out.write_text(json.dumps(dict(seen=sorted(seen), final=sorted(store._paths),
                                   loaded=loaded, missing=missing, bad=bad,
                                   warnings=warnings)))
""")

PUBLISHER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from kvnotes.core import files
    from kvnotes.core.fingerprint import ModelFingerprint

    staging, folder, plan = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
    files.HOST = plan["host"]  # this process plays a writer on another machine
    fingerprint = ModelFingerprint.from_dict(plan["fingerprint"])
    for ready in plan["wait_for"]:
        while not Path(ready).exists():
            time.sleep(0.02)
    entries = {}
    for key in plan["keys"]:
        entries[key] = files.read(staging / f"{key}.safetensors", fingerprint,
                                  file_format="kvnotes.notebook", version=1, what="skill")
    def _seen(status):
        try:
            return json.loads(Path(status).read_text())
        except (OSError, ValueError):
            return []

    published = []
    for round_, key in enumerate(plan["keys"]):
        published.append(key)
        for _ in range(2):  # the new one, then every one again (replaced in place)
            for k in published:
                if k != plan["deleted"] or round_ < plan["delete_after"]:
                    header, tensors = entries[k]
                    files.write(folder / f"{k}.safetensors", tensors, header)
            time.sleep(0.05)
        if round_ == plan["delete_after"]:
            while not all(plan["deleted"] in _seen(s) for s in plan["status"]):
                time.sleep(0.02)  # every reader has indexed it: now it goes
            (folder / f"{plan['deleted']}.safetensors").unlink()
        time.sleep(0.1)
""")


@pytest.fixture(scope="module")
def engine(tokenizer):
    # entries of most of a megabyte: a publish takes long enough for a reader to hit one midway
    return make_tiny_engine("llama", tokenizer, hidden_size=128, num_attention_heads=8,
                            num_key_value_heads=8, num_hidden_layers=4)


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout)


def test_two_readers_follow_a_folder_one_publisher_writes(engine, tmp_path):
    staged = ServingSkills(tmp_path / "staging", engine)
    texts = [f"Policy {i}: " + " ".join(f"rule {i}.{j} applies to orders of type {j}."
                                        for j in range(12)) for i in range(SKILLS)]
    keys = [staged.add(t, name=f"policy-{i}").key for i, t in enumerate(texts)]
    served = ServingSkills(tmp_path / "served", engine)  # the manifest, no entries yet
    folder = served.folder
    # temporaries left by dead processes: this host's (the publisher must leave it: another
    # machine's, from its point of view) and the publisher host's own (it must sweep that one)
    dead = _dead_pid()
    theirs = folder / f"{files.TMP_PREFIX}{files.HOST}.{dead}.abc.{keys[0]}.safetensors"
    own = folder / f"{files.TMP_PREFIX}{PUBLISHER_HOST}.{dead}.abc.{keys[0]}.safetensors"
    for tmp in (theirs, own):
        tmp.write_bytes(b"half an entry")
        old = time.time() - 2 * files.STALE_AGE_S
        os.utime(tmp, (old, old))

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH",
                                                                                  "")])}
    done = tmp_path / "done"
    readers = []
    for i in range(2):
        ready, out = tmp_path / f"ready-{i}", tmp_path / f"reader-{i}.json"
        status = tmp_path / f"seen-{i}.json"
        proc = subprocess.Popen([sys.executable, "-c", READER, str(folder), str(ready), str(done),
                                 str(out), str(status)], env=env, stderr=subprocess.PIPE,
                                text=True)
        readers.append((proc, ready, out, status))
    plan = dict(host=PUBLISHER_HOST, fingerprint=engine.fingerprint.to_dict(), keys=keys,
                deleted=keys[DELETED], delete_after=2,
                wait_for=[str(ready) for _, ready, _, _ in readers],
                status=[str(status) for *_, status in readers])
    publisher = subprocess.run([sys.executable, "-c", PUBLISHER, str(staged.folder), str(folder),
                                json.dumps(plan)], env=env, capture_output=True, text=True,
                               timeout=120)
    done.write_text("done")
    results = []
    for proc, _, out, _ in readers:
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        results.append(json.loads(out.read_text()))
    assert publisher.returncode == 0, publisher.stderr

    kept = sorted(set(keys) - {keys[DELETED]})
    for r in results:
        assert r["bad"] == [] and r["warnings"] == []  # never a partial or damaged entry
        assert r["seen"] == sorted(keys)  # every new skill picked up (the publisher deletes
        # one only once both readers have indexed it)
        assert r["final"] == kept  # and the deleted one dropped
        # every kept skill loaded whole (the deleted one may have gone before its first load)
        assert set(r["loaded"]) >= set(kept)
    assert not own.exists()  # the publisher's host swept its own dead temporary
    assert theirs.exists()  # and left another host's alone, dead pid and old as it is


def test_a_sweep_removes_only_this_hosts_dead_temporaries(tmp_path):
    dead = _dead_pid()
    old = time.time() - 2 * files.STALE_AGE_S
    names = {"mine-dead": f"{files.HOST}.{dead}", "mine-live": f"{files.HOST}.{os.getpid()}",
             "other-dead-old": f"other-host.{dead}", "other-live": f"other-host.{os.getpid()}"}
    paths = {}
    for what, tag in names.items():
        paths[what] = tmp_path / f"{files.TMP_PREFIX}{tag}.abc.entry.safetensors"
        paths[what].write_bytes(b"partial")
        if what == "other-dead-old":
            os.utime(paths[what], (old, old))
    assert files.sweep(tmp_path) == [paths["mine-dead"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        paths[w].name for w in ("mine-live", "other-dead-old", "other-live"))
    assert files.temp_prefix() == f"{files.TMP_PREFIX}{files.HOST}.{os.getpid()}."
    assert files.host_tag("gpu-7.rack2.example.org") == "gpu-7-rack2-example-org"
