"""Fleet hosts with no model in their process: each host's learner compiles by its server's
own prefill (a stand-in that saves what it is asked, as the connector would) and publishes to
the shared store; a second host takes the entry from the store instead of compiling it."""

from __future__ import annotations

import _fleet_hosts as fleet
import torch
from _fleet_hosts import chunk

from kvnotes.core import files
from kvnotes.serving.front.config import LearnConfig
from kvnotes.serving.learning.compiles import VllmCompiler
from kvnotes.serving.learning.fleet import FleetLearner, FleetSettings, request_path_settings
from kvnotes.serving.library.manifest import ENTRY_FORMAT, ENTRY_SUFFIX, ENTRY_VERSION
from kvnotes.serving.library.model_facts import ModelFacts
from kvnotes.serving.skills import ServingSkills
from kvnotes.serving.store.redis_store import RedisStore

redis_server = fleet.redis_server
TOOL = "lookup_booking: looks a booking up by its six-letter code and returns its flights."
HEADER = "You are the desk of Fjord Air.\n"


class SavingServer:
    """Saves each compile request's range as the connector would (zero KV: the store checks
    an entry's file, not its numbers)."""

    def __init__(self, skills: ServingSkills) -> None:
        self.folder, self.manifest, self.sent = skills.folder, skills.manifest, []

    def prefill(self, prompt, save) -> None:
        self.sent.append((list(prompt), save))
        m, n = self.manifest, save.end - save.start
        tensors = {"token_ids": torch.tensor(prompt[save.start:save.end]),
                   "positions": torch.arange(save.start, save.end)}
        for layer in range(m.num_layers):
            for part in ("keys", "values"):
                tensors[f"layers.{layer}.{part}"] = torch.zeros(1, m.num_kv_heads, n,
                                                                m.head_dim)
        meta = {"kind": "skill", "name": save.name, "prefix_ids": prompt[:save.start],
                "producer": "vllm", **({"tenant": save.tenant} if save.tenant else {})}
        files.write(self.folder / f"{save.key}{ENTRY_SUFFIX}", tensors, {
            "format": ENTRY_FORMAT, "version": ENTRY_VERSION, "fingerprint": m.fingerprint,
            "scheme": m.scheme, "length": n, "num_layers": m.num_layers, "origin": save.start,
            "spans": [[save.name, "skill", 0, n]], "meta": meta})


def test_fleet_hosts_compile_through_their_servers_and_share_the_entry(tmp_path, tiny_folder,
                                                                       redis_server):
    facts = ModelFacts.read(str(tiny_folder))
    made = []
    for name in ("a", "b"):
        skills = ServingSkills(tmp_path / name, facts)
        server = SavingServer(skills)
        store = RedisStore.connect(redis_server.url)
        learner = FleetLearner(
            LearnConfig(after=2, min_tokens=4), skills, store=store,
            request_store=RedisStore.connect(redis_server.url,
                                             settings=request_path_settings()),
            settings=FleetSettings(retry_s=0.2), prefill=server)
        assert isinstance(learner.compiler.inner, VllmCompiler)
        made.append((skills, server, learner))
    try:
        seen = chunk(facts.tokenizer, TOOL, after=HEADER)
        (a_skills, a_server, a), (b_skills, b_server, b) = made
        for _ in range(2):
            a.observe("acme", [seen])
        assert a.run_pending() == 1
        ((prompt, save),) = a_server.sent
        assert prompt == [*seen.after_ids, *seen.token_ids] and save.tenant == "acme"
        (listed,) = a.store.list(a_skills.folder.name, "acme")
        assert listed.key == save.key and listed.learned
        for _ in range(2):
            b.observe("acme", [seen])
        b.run_pending()
        assert b_server.sent == []  # taken from the store, not compiled again
        assert (b_skills.folder / f"{save.key}{ENTRY_SUFFIX}").read_bytes() == (
            a_skills.folder / f"{save.key}{ENTRY_SUFFIX}").read_bytes()
    finally:
        for _, _, learner in made:
            learner.store.close()
            learner.gate.store.close()
