"""The share floor in the server: phases aligned to the block, salts, the front's default and
``kvnotes serve --repair``'s spelling; the adaptive rule is refused there (engine only)."""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

import kvnotes
from kvnotes.cli import app
from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.repair import DEFAULT_FIRST, SERVER_REPAIR, Repair, repaired_end
from kvnotes.serving.front.app import FrontConfig
from kvnotes.serving.launch import launcher as launch_mod
from kvnotes.serving.planning.phases import PartSpan, plan_phases, server_repair


def layout(header: int = 40, skills: tuple[int, ...] = (100, 2000), user: int = 20
           ) -> list[PartSpan]:
    """[header at 0][skills compiled behind the header][user text]."""
    spans, pos = [PartSpan(0, header, 0, "header")], header
    for i, n in enumerate(skills):
        spans.append(PartSpan(pos, pos + n, header, f"s{i}"))
        pos += n
    return [*spans, PartSpan(pos, pos + user)]


@pytest.mark.parametrize("block", [16, 32, 128])
def test_share_floor_regions_end_on_block_boundaries(block):
    spans = layout(skills=(100, 300, 2000))
    plan = plan_phases(spans, Repair(first=32, share=0.1), block)
    # the first skill sits behind the header it was compiled behind: spliced whole
    assert [r[0] for r in plan.regions] == [140, 440]
    for (a, r), n in zip(plan.regions, (300, 2000), strict=True):
        assert r % block == 0 or r == a + n, (block, plan.regions)
        # at least the floor, less than one block past it
        floor = max(32, math.ceil(0.1 * n))
        assert a + floor <= r < a + floor + block or r == a + n
        assert r == repaired_end(a, a + n, 32, block, 0.1)
    # the connector supplies each repaired piece from its region's end
    assert [rg.to_list() for rg in plan.ranges][-2:] == [[140, plan.regions[0][1], 440],
                                                         [440, plan.regions[1][1], 2440]]
    assert plan.phase_ends == tuple(r for _, r in plan.regions)


def test_the_share_floor_changes_the_salt_and_grows_with_the_skill():
    fixed = plan_phases(layout(), Repair(first=32), 16, tenant="acme")
    floor = plan_phases(layout(), Repair(first=32, share=0.1), 16, tenant="acme")
    assert fixed.salt == "kvnotes-splice:acme+f32a16"
    assert floor.salt == "kvnotes-splice:acme+f32a16s0.1"
    assert floor.splice_request().tag == "f32a16s0.1"
    # the 100-token skill is exact behind the header; the 2000-token one gets 200, not 32,
    # ending at 340 rounded up to the block
    assert fixed.regions == ((140, 176),) and floor.regions == ((140, 352),)
    assert floor.repaired_tokens - fixed.repaired_tokens == 352 - 176


def test_server_repair_refuses_the_adaptive_rule():
    with pytest.raises(InvalidArgumentError, match="adaptive rule .* needs the engine"):
        server_repair(Repair(first=32, adapt=0.2), 16)
    assert server_repair(Repair(first=32, share=0.1), 16) == Repair(first=32, share=0.1,
                                                                     align=16)


def test_front_default_and_request_override():
    config = FrontConfig()
    assert config.repair_for(None) == SERVER_REPAIR
    assert config.repair == SERVER_REPAIR
    # a request's kvnotes.repair=K means its first K tokens, no share (one meaning of an int)
    assert config.repair_for(16) == Repair(first=16)
    assert FrontConfig(repair=Repair(first=8, share=0.2)).repair_for(None) == Repair(first=8,
                                                                                     share=0.2)
    # the one spelling reads the same in a config: K, K@F
    assert FrontConfig(repair="8@0.2").repair == Repair(first=8, share=0.2)
    assert FrontConfig(repair=16).repair == Repair(first=16)
    with pytest.raises(InvalidArgumentError, match="share"):
        FrontConfig(repair="32@1.5")
    # what only the engine runs is refused when the front is configured, not per request
    with pytest.raises(InvalidArgumentError, match="engine only"):
        FrontConfig(repair="32~0.2")
    with pytest.raises(InvalidArgumentError, match="engine only"):
        FrontConfig(repair=Repair(first=0, budget=8))


def test_serve_reads_the_repair_spelling(tmp_path, monkeypatch):
    seen: list[launch_mod.LaunchConfig] = []

    def fake_prepare(config, engine=None):
        seen.append(config)
        raise SystemExit(0)

    monkeypatch.setattr(kvnotes, "load", lambda model: None)
    monkeypatch.setattr(launch_mod, "prepare", fake_prepare)
    for spelled, first, share in (("32@0.1", 32, 0.1), ("8", 8, 0.0), (None, DEFAULT_FIRST,
                                                                       SERVER_REPAIR.share)):
        flags = [] if spelled is None else ["--repair", spelled]
        CliRunner().invoke(app, ["serve", "--skills", str(tmp_path / "s"), *flags])
        front = seen.pop().front
        assert front is not None and front.repair == Repair(first=first, share=share)
    result = CliRunner().invoke(app, ["serve", "--skills", str(tmp_path / "s"),
                                      "--repair", "32~0.2"])
    assert result.exit_code != 0 and not seen
    assert "engine only" in result.output or "engine only" in str(result.exception)
