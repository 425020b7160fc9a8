"""``KvnotesConnector`` itself, driven the way vLLM's scheduler and workers drive it, with fakes
of vLLM's objects: a request resumed after preemption is loaded, each tensor-parallel rank
writes its heads, a skill deleted after planning is reported for recompute, and what is refused
at start is refused by the connector.

The test environment has no vLLM (it lives in .venv-vllm); the connector's one vLLM import (the
base class, its metadata class and role enum) is then stood in for by a minimal module, the
interface of ``vllm/distributed/kv_transfer/kv_connector/v1/base.py`` 0.32 that the connector
uses. Where vLLM is importable, its real base class is used.
"""

from __future__ import annotations

import enum
import importlib
import logging
import subprocess
import sys
import types
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import make_tiny_engine

from kvnotes.core.errors import ServingError
from kvnotes.serving.library.manifest import splice_salt
from kvnotes.serving.library.splice import SpliceRange
from kvnotes.serving.protocol import SpliceReport, SpliceRequest
from kvnotes.serving.skills import ServingSkills
from kvnotes.serving.vllm.kv_writer import KvWriter, WorkerShare, rank_heads

BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
BLOCK = 16
SRC = Path(__file__).resolve().parents[2] / "src"


def _stub_vllm() -> list[str]:
    """Install a stand-in for vLLM's connector base module; returns the names installed."""

    class KVConnectorRole(enum.Enum):
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:
        pass

    class KVConnectorBase_V1:  # noqa: N801 -- vLLM's name
        def __init__(self, vllm_config, role, kv_cache_config):
            self._vllm_config = vllm_config
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._kv_cache_config = kv_cache_config
            self._role = role
            self._connector_metadata = None

        def bind_connector_metadata(self, metadata):
            self._connector_metadata = metadata

        def _get_connector_metadata(self):
            assert self._connector_metadata is not None
            return self._connector_metadata

    names = []
    parts = BASE.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        module = types.ModuleType(name)
        module.__path__ = []  # a package, so the next level imports
        sys.modules[name] = module
        names.append(name)
    base = sys.modules[BASE]
    base.KVConnectorRole, base.KVConnectorMetadata = KVConnectorRole, KVConnectorMetadata
    base.KVConnectorBase_V1 = KVConnectorBase_V1
    return names


@pytest.fixture(scope="module")
def cmod():
    try:
        importlib.import_module(BASE)
        installed: list[str] = []
    except ImportError:
        installed = _stub_vllm()
    sys.modules.pop("kvnotes.serving.vllm.connector", None)
    yield importlib.import_module("kvnotes.serving.vllm.connector")
    sys.modules.pop("kvnotes.serving.vllm.connector", None)
    for name in installed:
        sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def engine(tokenizer):
    return make_tiny_engine("llama", tokenizer, num_key_value_heads=4)


@pytest.fixture
def library(engine, tmp_path):
    engine.model.save_pretrained(tmp_path / "model")  # the weights the server "serves"
    skills = ServingSkills(tmp_path / "skills", engine, weights=tmp_path / "model")
    infos = [skills.add(t, name=n) for n, t in (("header", "System: answer briefly.\n"),
                                                ("refunds", "Refunds within 30 days.\n"),
                                                ("fees", "No fees on changes.\n"))]
    return skills, infos


class PagedImpl:
    """A cache write like vLLM's CPU backend's ([blocks, heads, block_size, 2 * head_dim])."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        assert key.device == kv_cache.device and key.shape[1] == kv_cache.shape[1]
        d = key.shape[-1]
        blocks, offsets = slot_mapping // kv_cache.shape[2], slot_mapping % kv_cache.shape[2]
        kv_cache[blocks, :, offsets, :d] = key
        kv_cache[blocks, :, offsets, d:] = value


def attention_layers(manifest, heads: int) -> dict[str, SimpleNamespace]:
    return {f"model.layers.{i}.self_attn.attn": SimpleNamespace(
        impl=PagedImpl(), num_kv_heads=heads, head_size=manifest.head_dim, kv_cache_dtype="auto",
        kv_cache=torch.zeros(12, heads, BLOCK, 2 * manifest.head_dim))
        for i in range(manifest.num_layers)}


def vllm_config(folder, *, layers=None, tp=1, policy="recompute", spec=None, lora=None):
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"skills": str(folder)},
                                           kv_load_failure_policy=policy),
        model_config=SimpleNamespace(
            model=str(Path(folder).parent.parent / "model"),  # the library fixture's weights
            hf_text_config=SimpleNamespace(num_hidden_layers=2, num_attention_heads=4,
                                           num_key_value_heads=4, head_dim=16, hidden_size=64),
            dtype=torch.float32, use_mla=False),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, decode_context_parallel_size=1,
                                        prefill_context_parallel_size=1),
        speculative_config=spec, lora_config=lora, cache_config=SimpleNamespace(block_size=BLOCK),
        compilation_config=SimpleNamespace(static_forward_context=layers or {}))


def rotary_for(manifest):
    inv = torch.tensor(manifest.inv_freqs[0], dtype=torch.float64)
    angles = torch.arange(4096, dtype=torch.float64)[:, None] * inv[None, :]
    return SimpleNamespace(cos_sin_cache=torch.cat((angles.cos(), angles.sin()), -1).float(),
                           is_neox_style=True)


def request(req_id, ids, salt="kvnotes-splice", params=None):
    return SimpleNamespace(request_id=req_id, cache_salt=salt, prompt_token_ids=list(ids),
                           mm_features=[], kv_transfer_params=params)


def leading(req_id, ids, tenant=None):
    """A request as ``ComposeClient`` sends one: its tenant's salt and a splice request for the
    prompt's leading run of skills."""
    return request(req_id, ids, splice_salt(tenant), SpliceRequest.leading(tenant).to_params())


def blocks(ids):
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def resumed(req_id, n):
    """A SchedulerOutput of the V1 runner's shape: the request resumed among the cached ones."""
    return SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={req_id: n},
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[req_id],
                                                                 resumed_req_ids={req_id}))


def workers(cmod, folder, manifest, tp, monkeypatch):
    """One started worker connector per tensor-parallel rank, with its layers."""
    out = []
    monkeypatch.setattr(cmod, "rotary_embeddings", lambda: [rotary_for(manifest)])
    for rank in range(tp):
        layers = attention_layers(manifest, len(rank_heads(manifest.num_kv_heads, tp, rank)))
        monkeypatch.setattr(cmod, "tensor_parallel", lambda rank=rank: (rank, tp))
        worker = cmod.KvnotesConnector(vllm_config(folder, layers=layers, tp=tp),
                                       cmod.KVConnectorRole.WORKER)
        worker.register_kv_caches({name: layer.kv_cache for name, layer in layers.items()})
        out.append((worker, layers))
    return out


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_a_resumed_request_is_spliced_by_every_rank_into_its_heads(cmod, library, tp,
                                                                   monkeypatch):
    skills, (header, refunds, fees) = library
    folder, manifest = skills.folder, skills.manifest
    sched = cmod.KvnotesConnector(vllm_config(folder, tp=tp), cmod.KVConnectorRole.SCHEDULER)
    ids = [*header.token_ids, *fees.token_ids, *refunds.token_ids, 5, 6]
    n = len(ids) - 2
    req = leading("r", ids, tenant="acme")
    # admitted, preempted, admitted again: only the last admission's blocks are written
    for block_ids in ([0, 1, 2, 3], [7, 9, 4, 11]):
        assert sched.get_num_new_matched_tokens(req, 0) == (n, False)
        sched.update_state_after_alloc(req, blocks(block_ids), n)
        meta = sched.build_connector_meta(resumed("r", len(ids)))
    (load,) = meta.loads
    assert (load.tenant, load.block_ids, load.start, load.end) == ("acme", (7, 9, 4, 11), 0, n)
    full = KvWriter(folder, manifest, WorkerShare(torch.device("cpu"), torch.float32,
                                                  range(manifest.num_kv_heads), (0, 1)))
    want_k, want_v = full.assemble(load)
    slots = load.slots()
    for rank, (worker, layers) in enumerate(workers(cmod, folder, manifest, tp, monkeypatch)):
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(SimpleNamespace(no_compile_layers=layers))
        assert worker.get_block_ids_with_load_errors() == set()
        heads = rank_heads(manifest.num_kv_heads, tp, rank)
        for i, layer in enumerate(layers.values()):
            got = layer.kv_cache[slots // BLOCK, :, slots % BLOCK]
            torch.testing.assert_close(got[..., :16], want_k[i][:, heads.start:heads.stop])
            torch.testing.assert_close(got[..., 16:], want_v[i][:, heads.start:heads.stop])


def test_a_skill_deleted_after_planning_is_recomputed(cmod, library, monkeypatch, caplog):
    skills, (header, refunds, _) = library
    folder, manifest = skills.folder, skills.manifest
    sched = cmod.KvnotesConnector(vllm_config(folder), cmod.KVConnectorRole.SCHEDULER)
    ids = [*header.token_ids, *refunds.token_ids, 5]
    req = leading("r", ids)
    ext, _ = sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, blocks([3, 8]), ext)
    meta = sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r": len(ids)}))
    (folder / f"{refunds.key}.safetensors").unlink()
    ((worker, layers),) = workers(cmod, folder, manifest, 1, monkeypatch)
    worker.bind_connector_metadata(meta)
    with caplog.at_level(logging.WARNING, logger="vllm.kvnotes"):
        worker.start_load_kv(SimpleNamespace(no_compile_layers=layers))
    failed = worker.get_block_ids_with_load_errors()
    assert failed and failed == set(meta.loads[0].written_blocks) <= {3, 8}
    assert worker.get_block_ids_with_load_errors() == set()  # reported once
    assert not any(layer.kv_cache.any() for layer in layers.values())
    assert "skill 'refunds'" in caplog.text and "gone from" in caplog.text
    # vLLM hands the failed blocks to the scheduler side; the request's report says so
    sched.update_connector_output(SimpleNamespace(invalid_block_ids=failed))
    delay, params = sched.request_finished(req, [3, 8])
    report = SpliceReport.from_params(params)
    assert delay is False and report is not None
    assert report.failed and report.recompute_from == min(a for a, _ in report.failed)
    assert refunds.key in report.entries and report.supplied < ext


def test_request_finished_returns_the_report_and_a_refused_message_splices_nothing(
        cmod, library, caplog):
    skills, (header, refunds, _) = library
    sched = cmod.KvnotesConnector(vllm_config(skills.folder), cmod.KVConnectorRole.SCHEDULER)
    ids = [*header.token_ids, *refunds.token_ids, 5]
    n = len(header) + len(refunds)
    asked = SpliceRequest((SpliceRange(0, 0, len(header)), SpliceRange(len(header),
                                                                       len(header), n)))
    ok = request("ok", ids, params=asked.to_params())
    assert sched.get_num_new_matched_tokens(ok, 0) == (n, False)
    sched.update_state_after_alloc(ok, blocks([1, 2, 3, 4]), n)
    sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"ok": len(ids)}))
    delay, params = sched.request_finished(ok, [1, 2, 3, 4])
    report = SpliceReport.from_params(params)
    assert delay is False and report is not None and report.supplied == n
    assert report.entries == (header.key, refunds.key) and report.computed == 1
    # another version, or a field this connector does not know: nothing is supplied
    for body in ({"v": 2, "ranges": []}, {"v": 1, "ranges": [], "mode": "all"}):
        bad = request("bad", ids, params={"kvnotes": body})
        with caplog.at_level(logging.WARNING, logger="vllm.kvnotes"):
            assert sched.get_num_new_matched_tokens(bad, 0) == (0, False)
        report = SpliceReport.from_params(sched.request_finished(bad, [])[1])
        assert report is not None and report.loaded == () and report.refused is not None
    assert "its splice request was refused (kvnotes splice request: version 2" in caplog.text
    assert "unknown field 'mode'" in caplog.text
    # an exact request (no splice request) gets no report
    assert sched.request_finished(request("x", ids, salt=None), []) == (False, None)


def test_only_requests_with_a_splice_request_are_spliced(cmod, library):
    skills, (header, refunds, _) = library
    sched = cmod.KvnotesConnector(vllm_config(skills.folder), cmod.KVConnectorRole.SCHEDULER)
    ids = [*header.token_ids, *refunds.token_ids, 5]
    assert sched.get_num_new_matched_tokens(leading("a", ids), 0) == (len(ids) - 1, False)
    assert sched.get_num_new_matched_tokens(leading("b", ids, "t-1"), 0)[0] > 0
    # a splice salt alone is an exact request: the connector reads no salt
    for salt in (None, "cold-1", "kvnotes-splice", "kvnotes-splice:t-1", "kvnotes-splice+f32a16"):
        assert sched.get_num_new_matched_tokens(request("c", ids, salt), 0) == (0, False)
        assert sched.request_finished(request("c", ids, salt), []) == (False, None)


def test_a_splice_request_names_its_tenant_and_the_salt_must_be_theirs(cmod, library, caplog):
    skills, (header, refunds, _) = library
    sched = cmod.KvnotesConnector(vllm_config(skills.folder), cmod.KVConnectorRole.SCHEDULER)
    ids = [*header.token_ids, *refunds.token_ids, 5]
    n = len(header) + len(refunds)
    ranges = (SpliceRange(0, 0, len(header)), SpliceRange(len(header), len(header), n))
    asked = SpliceRequest(ranges, tenant="acme", tag="f32a16")
    ok = request("ok", ids, "kvnotes-splice:acme+f32a16", asked.to_params())
    assert sched.get_num_new_matched_tokens(ok, 0) == (n, False)
    # the salt of another tenant (or of no tenant) than the message's: computed exactly
    for i, salt in enumerate(("kvnotes-splice:other+f32a16", "kvnotes-splice+f32a16")):
        wrong = request(f"w{i}", ids, salt, asked.to_params())
        with caplog.at_level(logging.WARNING, logger="vllm.kvnotes"):
            assert sched.get_num_new_matched_tokens(wrong, 0) == (0, False)
        report = SpliceReport.from_params(sched.request_finished(wrong, [])[1])
        assert report is not None and report.loaded == () and "is not" in report.refused
    # a tenant that no salt may hold is refused the same way
    bad = SpliceRequest(ranges, tenant="a b")
    assert sched.get_num_new_matched_tokens(
        request("b", ids, "kvnotes-splice", bad.to_params()), 0) == (0, False)
    # another salt altogether: refused the same way (computed exactly; its report says why)
    assert sched.get_num_new_matched_tokens(request("x", ids, "cold", asked.to_params()),
                                            0) == (0, False)
    report = SpliceReport.from_params(sched.request_finished(request("x", ids, "cold"), [])[1])
    assert report is not None and "'cold' is not" in report.refused
    # the leading run asked with another tenant's salt: refused
    assert sched.get_num_new_matched_tokens(
        request("y", ids, "kvnotes-splice:acme", SpliceRequest.leading().to_params()),
        0) == (0, False)


def test_refusals_at_start(cmod, library, monkeypatch, caplog):
    skills, _ = library
    draft = SimpleNamespace(method="eagle3", uses_draft_kv_cache=lambda: True)
    with pytest.raises(ServingError, match="speculative decoding 'eagle3'"):
        cmod.KvnotesConnector(vllm_config(skills.folder, spec=draft),
                              cmod.KVConnectorRole.SCHEDULER)
    ngram = SimpleNamespace(method="ngram", uses_draft_kv_cache=lambda: False)
    cmod.KvnotesConnector(vllm_config(skills.folder, spec=ngram), cmod.KVConnectorRole.SCHEDULER)
    with pytest.raises(ServingError, match="LoRA is enabled"):
        cmod.KvnotesConnector(vllm_config(skills.folder, lora=object()),
                              cmod.KVConnectorRole.WORKER)
    with pytest.raises(ServingError, match="cannot be split over 3 tensor-parallel ranks"):
        cmod.KvnotesConnector(vllm_config(skills.folder, tp=3), cmod.KVConnectorRole.SCHEDULER)
    with caplog.at_level(logging.WARNING, logger="vllm.kvnotes"):
        cmod.KvnotesConnector(vllm_config(skills.folder, policy="fail"),
                              cmod.KVConnectorRole.SCHEDULER)
    assert "kv_load_failure_policy is 'fail'" in caplog.text
    # the served model rotates with another RoPE base: refused when the caches are registered
    manifest = skills.manifest
    layers = attention_layers(manifest, 4)
    monkeypatch.setattr(cmod, "tensor_parallel", lambda: (0, 1))
    wrong = rotary_for(replace(manifest, inv_freqs=[[f / 2 for f in manifest.inv_freqs[0]]] * 2))
    monkeypatch.setattr(cmod, "rotary_embeddings", lambda: [wrong])
    worker = cmod.KvnotesConnector(vllm_config(skills.folder, layers=layers),
                                   cmod.KVConnectorRole.WORKER)
    with pytest.raises(ServingError, match="is none of the served model's rotary embeddings"):
        worker.register_kv_caches({n: layer.kv_cache for n, layer in layers.items()})


def test_the_connectors_modules_import_no_engine():
    """vLLM's process imports the connector: its own modules stay free of kvnotes' engine,
    kvnotes.ops and transformers (the package root is stubbed out, as vLLM never needs it)."""
    code = (
        "import sys, types, importlib\n"
        f"pkg = types.ModuleType('kvnotes'); pkg.__path__ = [{str(SRC / 'kvnotes')!r}]\n"
        "sys.modules['kvnotes'] = pkg\n"
        "for m in ('vllm.plans', 'vllm.kv_writer', 'vllm.checks', 'library.piece_store'):\n"
        "    importlib.import_module('kvnotes.serving.' + m)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('transformers', 'vllm')\n"
        "       or m == 'kvnotes.core.engine' or m.startswith('kvnotes.ops')\n"
        "       or m == 'kvnotes.serving.skills']\n"
        "print(sorted(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout
