"""Registering skills on a running front (``POST /kvnotes/skills``) and its readiness, over a
library with no model in the process and a stand-in server that saves what it is asked."""

from __future__ import annotations

import httpx2
import pytest
from _front_fakes import FakeVLLM

from kvnotes.serving.front.app import Front, FrontConfig
from kvnotes.serving.front.skill_desk import SKILLS_PATH, SkillDesk
from kvnotes.serving.library.manifest import ENTRY_SUFFIX
from kvnotes.serving.library.model_facts import ModelFacts
from kvnotes.serving.planning.match import SkillCatalog
from kvnotes.serving.skills import ServingSkills

OPERATOR = "sk-operator-1"


class SavingServer:
    """Writes an entry file for each compile request, as the connector would."""

    def __init__(self, folder) -> None:
        self.folder, self.sent = folder, []

    def prefill(self, prompt, save) -> None:
        self.sent.append((list(prompt), save))
        (self.folder / f"{save.key}{ENTRY_SUFFIX}").write_bytes(b"entry")


@pytest.fixture
def desk_front(tmp_path, tiny_folder, fake: FakeVLLM):
    skills = ServingSkills(tmp_path, ModelFacts.read(str(tiny_folder)))
    server = SavingServer(skills.folder)
    skills.attach(server)
    desk = SkillDesk(skills)
    front = Front(FrontConfig(upstream=fake.url, api_key=OPERATOR),
                  SkillCatalog(skills.folder, skills.tokenizer), desk=desk)
    with front:
        yield front, desk, server


def test_health_waits_for_the_skills_then_is_vllms(desk_front):
    front, desk, _ = desk_front
    resp = httpx2.get(front.url + "/health")
    assert resp.status_code == 503 and "compiling its skills" in resp.text
    desk.ready.set()
    assert httpx2.get(front.url + "/health").status_code == 200


def test_a_skill_is_registered_with_the_operators_key_only(desk_front):
    front, _, server = desk_front
    body = {"skills": [{"name": "refunds", "text": "REFUNDS: within 30 days."}],
            "header": "You are a desk.\n"}
    url = front.url + SKILLS_PATH
    assert httpx2.post(url, json=body).status_code == 401
    assert httpx2.post(url, json=body, headers={"Authorization": "Bearer nope"}
                       ).status_code == 401
    resp = httpx2.post(url, json=body, headers={"Authorization": f"Bearer {OPERATOR}"})
    assert resp.status_code == 200, resp.text
    ((row,),) = [resp.json()["skills"]]
    ((prompt, save),) = server.sent
    assert row["name"] == "refunds" and row["key"] == save.key
    assert row["tokens"] == save.end - save.start == len(prompt) - save.start > 0
    bad = httpx2.post(url, json={"skills": [{"name": "x", "txt": "y"}]},
                      headers={"Authorization": f"Bearer {OPERATOR}"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "skills.0.text"
