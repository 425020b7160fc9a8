"""Compiling by the server's prefill, without vLLM: the scheduler side follows a compile
request's blocks and hands its save to the workers only in the step that completes its range
(an aborted or preempted-then-aborted request saves nothing); the worker side reads a paged
cache back through a checked layout and writes the entry whole, or fails, counted, leaving no
file; the learner's vLLM compiler addresses entries as the engine's library does."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from kvnotes.core.fingerprint import ModelFingerprint
from kvnotes.serving.learning.compiles import VllmCompiler
from kvnotes.serving.learning.sightings import Job
from kvnotes.serving.library.manifest import ENTRY_SUFFIX, ServingManifest, read_entry
from kvnotes.serving.library.registry import LearnedRegistry
from kvnotes.serving.planning.chunks import SeenChunk
from kvnotes.serving.protocol import ProtocolError, SaveRequest, SpliceRequest
from kvnotes.serving.server_prefill import EntryAddress, SaveFailed
from kvnotes.serving.vllm.kv_saver import CacheReader, KvSaver, UnreadableCache
from kvnotes.serving.vllm.saves import SaveTracker, save_request

LAYERS, HEADS, DIM, BLOCK, BLOCKS = 2, 3, 8, 4, 6
FP = ModelFingerprint("Tiny", "llama", "c", "t", "w", "float32", LAYERS)


def manifest(bos: int | None = None) -> ServingManifest:
    return ServingManifest(fingerprint=FP.to_dict(), model="tiny", scheme="rope",
                           num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, vocab_size=100,
                           bos_id=bos, inv_freqs=[[1.0, 0.1, 0.01, 0.001]] * LAYERS)


# ---- the scheduler side ----------------------------------------------------------------------
def new(req_id: str, blocks: list[int], computed: int = 0) -> NS:
    return NS(req_id=req_id, block_ids=(blocks,), num_computed_tokens=computed)


def step(new_reqs=(), cached=None, **scheduled: int) -> NS:
    return NS(scheduled_new_reqs=list(new_reqs), scheduled_cached_reqs=cached,
              num_scheduled_tokens=scheduled)


def cached(req_id: str, blocks: list[int] | None, computed: int, resumed: bool = False) -> NS:
    return NS(req_ids=[req_id], new_block_ids=[None if blocks is None else (blocks,)],
              num_computed_tokens=[computed], resumed_req_ids={req_id} if resumed else set())


def test_a_save_is_emitted_in_the_step_that_completes_its_range_with_every_block():
    t = SaveTracker(block_size=BLOCK)
    t.track("r", SaveRequest("a" * 32, 3, 10, "x"), list(range(12)))
    assert t.take(step([new("r", [4, 5], computed=4)], r=4)) == []  # tokens 4..7: chunk one
    (spec,) = t.take(step(cached=cached("r", [9], 8), r=4))  # 8..11: the range is done
    assert spec.block_ids == (4, 5, 9) and spec.behind == (0, 1, 2)
    assert spec.token_ids == tuple(range(3, 10)) and spec.slots().tolist() == [
        19, 20, 21, 22, 23, 36, 37]
    assert t.take(step(cached=cached("r", None, 12), r=1)) == []  # once only
    assert t.finished("r") and len(t) == 0


def test_an_aborted_or_preempted_compile_saves_nothing_until_its_range_is_computed():
    t = SaveTracker(block_size=BLOCK)
    t.track("a", SaveRequest("a" * 32, 0, 8, "x"), list(range(8)))
    assert t.take(step([new("a", [1, 2])], a=4)) == []
    assert not t.finished("a")  # aborted mid-prefill: nothing was handed to the workers
    t.track("p", SaveRequest("b" * 32, 0, 8, "y"), list(range(8)))
    assert t.take(step([new("p", [1, 2])], p=4)) == []
    # preempted, resumed from zero with new blocks: the new ones are the request's
    (spec,) = t.take(step(cached=cached("p", [7, 3], 0, resumed=True), p=8))
    assert spec.block_ids == (7, 3)


def test_save_requests_are_read_strictly_and_kept_apart_from_splice_requests():
    msg = SaveRequest("c" * 32, 1, 3, "n", "acme")
    params = msg.to_params()
    assert SpliceRequest.from_params(params) is None  # another key
    assert save_request(NS(kv_transfer_params=params, prompt_token_ids=[0, 1, 2]))[0] == msg
    _, why = save_request(NS(kv_transfer_params=params, prompt_token_ids=[0, 1]))
    assert why is not None and "past the prompt" in why
    for bad in ({"v": 1, "key": "../../etc", "start": 0, "end": 1},
                {"v": 1, "key": "c" * 32, "start": 2, "end": 2},
                {"v": 1, "key": "c" * 32, "start": 0, "end": 1, "extra": 1}):
        with pytest.raises(ProtocolError):
            SaveRequest.from_params({"kvnotes_save": bad})


# ---- the worker side ---------------------------------------------------------------------------
class CpuImpl:
    """The CPU backend's write: ``[blocks, heads, block, 2*dim]``, keys then values per block."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        nb, heads, bs, _ = kv_cache.shape
        view = kv_cache.view(nb, heads, 2 * bs, -1)
        b, o = slot_mapping // bs, slot_mapping % bs
        view[b, :, o] = key
        view[b, :, o + bs] = value


class VecImpl:
    """The CPU backend's ``vec`` kernels: each block's keys transposed per head
    (``[dim, block]``), then its values (``[block, dim]``)."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        nb, heads, bs, _ = kv_cache.shape
        flat = kv_cache.view(nb, heads, 2 * bs * DIM)
        for i, slot in enumerate(slot_mapping.tolist()):
            b, o = divmod(slot, bs)
            for d in range(DIM):
                flat[b, :, d * bs + o] = key[i, :, d]
            flat[b, :, bs * DIM + o * DIM:bs * DIM + (o + 1) * DIM] = value[i]


class ScaledImpl(CpuImpl):
    """A cache that stores keys scaled (as fp8 caches do): not read back exactly."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        super().do_kv_cache_update(layer, key * 0.5, value, kv_cache, slot_mapping)


def layers(impl=None) -> list[tuple[int, NS]]:
    torch.manual_seed(0)
    return [(i, NS(kv_cache=torch.randn(BLOCKS, HEADS, BLOCK, 2 * DIM), impl=impl or CpuImpl()))
            for i in range(LAYERS)]


def saver(tmp_path, heads: range = range(HEADS)) -> KvSaver:
    return KvSaver(tmp_path, manifest(), heads=heads, head_dim=DIM, block_size=BLOCK,
                   dtype=torch.float32)


def spec_for(key: str = "d" * 32):
    t = SaveTracker(block_size=BLOCK)
    t.track("r", SaveRequest(key, 2, 7, "doc", "acme"), list(range(10, 18)))
    (spec,) = t.take(step([new("r", [3, 1])], r=8))
    return spec


def test_the_worker_saves_the_blocks_kv_as_an_entry(tmp_path):
    ls, spec = layers(), spec_for()
    assert saver(tmp_path).save([spec], ls) == 1
    info, keys, values = read_entry(tmp_path / f"{spec.key}{ENTRY_SUFFIX}", FP)
    assert info.token_ids == (12, 13, 14, 15, 16) and info.origin == 2
    assert info.tenant == "acme" and info.behind == (10, 11)
    reader = CacheReader.of(ls[1][1], BLOCK, HEADS, DIM, torch.float32)
    want_k, want_v = reader.read(ls[1][1].kv_cache, spec.slots())
    assert torch.equal(keys[1], want_k) and torch.equal(values[1], want_v)
    # block 3 holds positions 0..3, block 1 positions 4..7; per block and head, the keys'
    # rows then the values' (the CPU backend's [2 * block, dim] view)
    view = ls[0][1].kv_cache.view(BLOCKS, HEADS, 2 * BLOCK, DIM)
    assert torch.equal(keys[0][0], view[3, :, 2]) and torch.equal(values[0][3],
                                                                  view[1, :, 1 + BLOCK])


def test_the_layout_is_learned_from_the_backends_own_write(tmp_path):
    """Keys transposed per head (the CPU ``vec`` kernels): the same KV read back."""
    plain, vec = layers(), layers(VecImpl())
    k = torch.randn(2 * BLOCK, HEADS, DIM)
    v = torch.randn(2 * BLOCK, HEADS, DIM)
    slots = torch.tensor([3 * BLOCK + i for i in range(BLOCK)] + [BLOCK + i for i in range(BLOCK)])
    for _, layer in plain + vec:
        layer.impl.do_kv_cache_update(layer, k, v, layer.kv_cache, slots)
    spec = spec_for()
    assert saver(tmp_path / "a").save([spec], plain) == 1
    assert saver(tmp_path / "b").save([spec], vec) == 1
    fp = FP
    (_, ka, va), (_, kb, vb) = (read_entry(tmp_path / d / f"{spec.key}{ENTRY_SUFFIX}", fp)
                                for d in ("a", "b"))
    assert torch.equal(ka, kb) and torch.equal(va, vb)
    assert torch.equal(ka[0], k[2:7])  # positions 2..6: block 3's rows 2, 3, block 1's 0..2


def test_a_layout_that_does_not_read_back_refuses_every_save_counted(tmp_path):
    s = saver(tmp_path)
    assert s.save([spec_for()], layers(ScaledImpl())) == 0
    assert s.failed == 1 and not list(tmp_path.iterdir())
    odd = NS(kv_cache=torch.zeros(BLOCKS, BLOCK, HEADS, DIM), impl=CpuImpl())
    with pytest.raises(UnreadableCache):
        CacheReader.of(odd, BLOCK, HEADS, DIM, torch.float32)


def test_a_save_that_cannot_be_written_or_a_partial_share_leaves_no_file(tmp_path):
    spec = spec_for()
    (tmp_path / f"{spec.key}{ENTRY_SUFFIX}").mkdir()  # something else where the file goes
    s = saver(tmp_path)
    assert s.save([spec], layers()) == 0 and s.failed == 1
    tp = saver(tmp_path / "tp", heads=range(1))  # a tensor-parallel rank's share
    assert tp.save([spec], layers()) == 0 and tp.failed == 1
    assert not (tmp_path / "tp").exists()


# ---- the learner's compiler --------------------------------------------------------------------
class FakeServer:
    """Saves what it is asked, as the connector would (or nothing, ``save=False``)."""

    def __init__(self, folder, save: bool = True) -> None:
        self.folder, self.save, self.sent = folder, save, []

    def prefill(self, prompt, message: SaveRequest) -> None:
        self.sent.append((list(prompt), message))
        if self.save:
            (self.folder / f"{message.key}{ENTRY_SUFFIX}").write_bytes(b"entry")


def test_the_vllm_compiler_sends_the_chunk_behind_its_anchor_and_checks_the_entry(tmp_path):
    m = manifest(bos=1)
    server = FakeServer(tmp_path)
    compiler = VllmCompiler(tmp_path, LearnedRegistry(tmp_path), EntryAddress.of(m), server)
    chunk = SeenChunk("tool", "t", (7, 8, 9), (1, 5, 6))
    done = compiler.compile(Job(b"\x01" * 16, "acme", chunk))
    ((prompt, msg),) = server.sent
    assert prompt == [1, 5, 6, 7, 8, 9] and (msg.start, msg.end, msg.tenant) == (3, 6, "acme")
    assert done.new and done.entry is not None and done.entry.tokens == 3
    assert done.key == EntryAddress.of(m).key((7, 8, 9), (1, 5, 6), "acme") == msg.key
    alone = compiler.compile(Job(b"\x02" * 16, None, SeenChunk("tool", "t", (7, 8), ())))
    assert server.sent[-1][0] == [1, 7, 8] and alone.new  # the anchor: BOS alone
    lost = VllmCompiler(tmp_path, LearnedRegistry(tmp_path), EntryAddress.of(m),
                        FakeServer(tmp_path, save=False))
    with pytest.raises(SaveFailed):
        lost.compile(Job(b"\x03" * 16, None, SeenChunk("tool", "t", (4, 4), ())))


def test_a_bfloat16_servers_entries_are_keyed_apart_from_the_engines():
    m = manifest()
    f32, bf16 = EntryAddress.of(m), EntryAddress.of(m, "bfloat16")
    assert f32.producer_tag is None and bf16.producer_tag == "vllm-bfloat16"
    assert f32.key((3, 4), (1,), None) != bf16.key((3, 4), (1,), None)


# ---- serve: one copy of the weights ------------------------------------------------------------
def test_a_library_without_a_model_is_compiled_by_its_server(tmp_path, monkeypatch):
    """Gemma 3 (a BOS model) read from its folder, its weights never loaded: the start entry
    and each skill are the server's prefill of the ids the engine's library would compile,
    under the engine's keys."""
    from transformers import AutoModelForCausalLM

    from kvnotes.core.document import encode
    from kvnotes.core.errors import ServingError
    from kvnotes.ops.store import skill_key
    from kvnotes.serving.library.model_facts import ModelFacts
    from kvnotes.serving.skills import ServingSkills

    def refuse(*args, **kwargs):
        raise AssertionError("the model's weights were loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    facts = ModelFacts.read("gemma3-270m")
    bos, tok = facts.bos_id, facts.tokenizer
    assert bos is not None
    skills = ServingSkills(tmp_path, facts)
    header, text = "You are the desk of Fjord Air.\n", "REFUNDS: unworn items within 30 days."
    with pytest.raises(ServingError, match="--server"):
        skills.add(text)
    server = FakeServer(skills.folder)
    skills.attach(server)
    skills.start_entry()
    ((prompt, msg),) = server.sent
    assert prompt == [bos] and (msg.start, msg.end, msg.name) == (0, 1, "bos")
    assert msg.key == skill_key(facts.fingerprint.id, "rope", "start", [bos])
    info = skills.add(text, name="refunds", after=header)
    prompt, msg = server.sent[-1]
    lead = [bos, *encode(tok, header)]
    assert prompt == [*lead, *encode(tok, text)] and (msg.start, msg.end) == (
        len(lead), len(prompt))
    assert (info.key, info.origin, info.behind) == (msg.key, len(lead), tuple(lead))
    assert info.key == skill_key(facts.fingerprint.id, "rope", "bos", list(info.token_ids),
                                 after=lead) == skills.path_for(text, after=header).stem
    assert skills.add(text, name="refunds", after=header) == info and len(server.sent) == 2


def test_a_library_by_model_name_reads_its_facts_in_a_child_and_keeps_model_code_out(tmp_path):
    """``ServingSkills(root, NAME)`` (``kvnotes serve``'s front): the same manifest, folder and
    tokenizer as from :class:`ModelFacts`, with neither the engine's modules nor transformers'
    model classes imported in the serving process (the CLI's included); a model it cannot read
    is the child's error, raised here as the same class."""
    import json
    import subprocess
    import sys

    from kvnotes.core.errors import UnknownModelError
    from kvnotes.serving.library.model_facts import ModelFacts
    from kvnotes.serving.skills import ServingSkills

    text = "REFUNDS: unworn items within 30 days."
    code = ("import json, sys, kvnotes.cli; from kvnotes.serving.skills import ServingSkills; "
            f"s = ServingSkills({str(tmp_path / 'a')!r}, 'gemma3-270m'); "
            "s.address.key((5, 6), (2,), None); "  # a learned entry's key, as the learner reads it
            "print(json.dumps([s.folder.name, s.anchor, s.manifest.to_json(), "
            f"s.tokenizer({text!r})['input_ids'], [m for m in ('kvnotes.core.engine', "
            "'transformers.modeling_utils') if m in sys.modules]]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()[-1]
    facts = ModelFacts.read("gemma3-270m")
    by_facts = ServingSkills(tmp_path / "b", facts)
    assert json.loads(out) == [by_facts.folder.name, "bos", by_facts.manifest.to_json(),
                               facts.tokenizer(text)["input_ids"], []]
    with pytest.raises(UnknownModelError, match="no-such-model"):
        ServingSkills(tmp_path / "d", "no-such-model")
