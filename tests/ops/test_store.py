"""The skill library: entries addressed by content, the anchoring prefix included."""

from __future__ import annotations

import torch

from kvnotes.ops.store import SkillLibrary

POLICY = "Refunds are issued within five days. Final-sale items cannot be returned."
HEADER = "System: you are the support agent of a small shop.\n\n"


def test_library_keys_skills_by_their_anchor_prefix(tiny_llama, tmp_path):
    lib = SkillLibrary(tmp_path, tiny_llama)
    paths = {lib.path_for(POLICY), lib.path_for(POLICY, after=HEADER),
             lib.path_for(POLICY, after="Another header.\n")}
    assert len(paths) == 3  # one entry per anchoring
    # the same prefix as text or as its token ids is one entry
    ids = tiny_llama.anchor_ids(HEADER)
    assert lib.path_for(POLICY, after=ids) == lib.path_for(POLICY, after=HEADER)
    miss = lib.get(POLICY, name="refunds", after=HEADER)
    hit = lib.get(POLICY, name="refunds", after=HEADER)
    assert (lib.misses, lib.hits) == (1, 1)
    direct = tiny_llama.compile(POLICY, after=HEADER)
    assert hit.positions.tolist() == direct.positions.tolist() == miss.positions.tolist()
    assert torch.allclose(hit.keys(0), direct.keys(0), atol=1e-6)
    plain = lib.get(POLICY, name="refunds")  # unanchored: its own entry, positions from 0
    assert lib.misses == 2 and int(plain.positions[0]) == 0
