"""``kvnotes serve`` with one model copy, on the session's real vLLM server (``vllm_launch``:
SmolLM2 float32, CPU): a front whose library holds no model (read from the model's files)
writes the engine's manifest, registers skills through ``kvnotes skills add --server`` that
the server's own prefill compiles under the engine's keys, and a prompt holding them is
spliced and answers as its exact counterpart (``splice: false``)."""

from __future__ import annotations

import httpx2
import pytest
from conftest import skill_copy, wait_for_rescan
from typer.testing import CliRunner

from kvnotes.cli import app
from kvnotes.core import files
from kvnotes.serving.front.app import Front, FrontConfig
from kvnotes.serving.front.skill_desk import SkillDesk
from kvnotes.serving.library.model_facts import ModelFacts
from kvnotes.serving.planning.match import SkillCatalog
from kvnotes.serving.server_prefill import VllmPrefill
from kvnotes.serving.skills import ServingSkills, manifest_for

pytestmark = pytest.mark.vllm

OWNER = "vcserve"  # this module's texts and tenant
HEADER = f"You are the support agent of the {OWNER} desk. Answer in one short sentence.\n"
USER = "\n\nCustomer: can I return shoes I wore once?\nAgent:"


def test_a_front_without_the_model_registers_skills_vllm_compiles(vllm_launch, smollm2,
                                                                   tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    def refuse(*args, **kwargs):
        raise AssertionError("the front loaded the model's weights")

    launch = vllm_launch
    assert launch.skills is not None
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    facts = ModelFacts.read("smollm2-135m")
    lib = ServingSkills(launch.skills.folder.parent, facts)
    assert lib.folder == launch.skills.folder  # the same fingerprint: the engine's folder
    # the manifest the session's engine wrote, byte for byte
    assert (lib.folder / "serving.json").read_text() == manifest_for(facts).to_json() \
        == manifest_for(smollm2).to_json()
    lib.attach(VllmPrefill(launch.server.url, launch.server.served_name))
    desk = SkillDesk(lib)
    name = launch.server.served_name
    skill = skill_copy("refunds", OWNER)
    (tmp_path / "header.txt").write_text(HEADER)
    (tmp_path / "refunds.txt").write_text(skill)

    def complete(front: Front, **opts: object) -> dict:
        body = {"model": name, "prompt": HEADER + skill + USER, "max_tokens": 8,
                "temperature": 0, "kvnotes": {"tenant": OWNER, **opts}}
        resp = httpx2.post(front.url + "/v1/completions", json=body, timeout=600)
        assert resp.status_code == 200, resp.text
        return dict(resp.json())

    with Front(FrontConfig(upstream=launch.server.url, guard=0.0),
               SkillCatalog(lib.folder, facts.tokenizer), desk=desk) as front:
        desk.ready.set()
        added = []
        for args in (["header.txt"], ["refunds.txt", "--header", "header.txt"]):
            result = CliRunner().invoke(app, ["skills", "add", *(
                str(tmp_path / a) if a.endswith(".txt") else a for a in args),
                "--server", front.url])
            assert result.exit_code == 0, result.output
            added.append(result.output.strip().split("\t"))
        (head_row, skill_row) = added
        assert skill_row[0] == "refunds" and int(skill_row[1].split()[0]) > 100
        path = lib.entry_path(skill_row[2])
        header, _ = files.read(path, facts.fingerprint, file_format="kvnotes.notebook",
                               version=1, what="skill")
        assert header["meta"]["producer"] == "vllm"
        # a float32 server's entry has the engine's key: interchangeable with `skills add`'s
        engine_lib = ServingSkills(tmp_path / "engine", smollm2)
        assert skill_row[2] == engine_lib.path_for(skill, after=HEADER).stem
        assert head_row[2] == engine_lib.path_for(HEADER).stem
        wait_for_rescan()
        spliced = complete(front)
        exact = complete(front, splice=False)
    assert spliced["usage"]["kvnotes"]["spliced_tokens"] > 100
    assert exact["usage"]["kvnotes"]["exact"] == "opted_out"
    assert spliced["choices"][0]["text"] == exact["choices"][0]["text"]
