"""The connector on a real vLLM CPU server whose KV cache is too small for its load: spliced
requests preempted and resumed answer exactly as the same requests never preempted, and a
skill damaged after it was indexed is recomputed, not failed.

On the session's server (``vllm_launch``: 128 KV blocks of 32 tokens). SmolLM2 in float32; 8
concurrent spliced requests of about 480 prompt tokens, each in its own tenant (so no two share
a block), generating 128 tokens each with ``ignore_eos``, need about 156 blocks, so vLLM
preempts some and resumes them later.
"""

from __future__ import annotations

import math
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import VLLM_BLOCK, VLLM_KV_BLOCKS, skill_copy, wait_for_rescan

from kvnotes.apps.agent.prompt import HEADER
from kvnotes.serving.compose_client import ComposeClient, cold_salt
from kvnotes.serving.launch.launcher import Launch
from kvnotes.serving.library.manifest import splice_salt
from kvnotes.serving.planning.layout import prompt_ids
from kvnotes.serving.protocol import SpliceReport, SpliceRequest

pytestmark = pytest.mark.vllm

USER = ("\n\nCustomer Mei Lin (booking C48213) writes: I booked 2 days ago and want to cancel. "
        "List every step I have to take and what I get back.\nAgent:")
SKILLS = ("refunds", "baggage", "cancellation", "compensation")
OWNER = "connector"  # this module's skill texts and names
COPIES = 2
ANSWER_TOKENS = 128


@pytest.fixture(scope="module")
def small(vllm_launch):
    """The session's server with this module's skills published."""
    assert vllm_launch.skills is not None
    vllm_launch.skills.add(HEADER, name="header")
    for name in SKILLS:
        vllm_launch.skills.add(skill_copy(name, OWNER), name=f"{OWNER}-{name}")
    wait_for_rescan()
    return vllm_launch


def log_since(launch: Launch, offset: int) -> str:
    """What the server logged after ``offset`` bytes (the log is the whole session's)."""
    with open(launch.server.log_path, "rb") as f:
        f.seek(offset)
        return f.read().decode("utf-8", errors="replace")


def leading(tenant: str) -> dict:
    """The ``kv_transfer_params`` of a request for the prompt's leading run of skills."""
    return SpliceRequest.leading(tenant).to_params()


def openai_client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="kvnotes", timeout=3600, max_retries=0)


def preemptions(url: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return sum(float(m.group(1)) for m in
               re.finditer(r"^vllm:num_preemptions_total(?:\{[^}]*\})? (\S+)$", text, re.M))


def test_preempted_spliced_requests_answer_as_alone(small, smollm2):
    url = small.server.url
    client = openai_client(url)
    prompts = [prompt_ids(smollm2.tokenizer, [HEADER, skill_copy(name, OWNER), USER])
               for name in SKILLS]
    jobs = [(i, prompts[i]) for _ in range(COPIES) for i in range(len(prompts))]
    need = sum(math.ceil((len(ids) + ANSWER_TOKENS) / VLLM_BLOCK) for _, ids in jobs)
    assert need > VLLM_KV_BLOCKS, f"{need} blocks of load fit the cache: no preemption"

    def complete(ids, tenant):
        r = client.completions.create(
            model=small.server.served_name, prompt=ids, max_tokens=ANSWER_TOKENS,
            temperature=0.0, extra_body={"cache_salt": splice_salt(tenant), "ignore_eos": True,
                                         "kv_transfer_params": leading(tenant)})
        return r.choices[0].text

    before, log_start = preemptions(url), small.server.log_path.stat().st_size
    with ThreadPoolExecutor(len(jobs)) as pool:  # a tenant each: no block is shared
        under_load = list(pool.map(lambda k: complete(jobs[k][1], f"load-{k}"),
                                   range(len(jobs))))
    after = preemptions(url)
    preempted = after - before
    assert preempted > 0, "no preemption: the test needs a smaller KV cache or more requests"
    # each prompt once, in a fresh tenant namespace: spliced from scratch; the four fit the
    # cache together, so none is preempted
    with ThreadPoolExecutor(len(prompts)) as pool:
        unpreempted = list(pool.map(
            lambda i: complete(prompts[i], f"alone-{i}"), range(len(prompts))))
    assert preemptions(url) == after
    wrong = [k for k, (i, _) in enumerate(jobs) if under_load[k] != unpreempted[i]]
    assert wrong == [], f"{len(wrong)} of {len(jobs)} differ ({preempted:.0f} preemptions)"
    log = log_since(small, log_start)
    splices = len(re.findall(r"request \S+ \(tenant load-\d+\): spliced tokens", log))
    # a resumed request is spliced again unless its blocks are still in the prefix cache
    print(f"{len(jobs)} requests, {need} blocks of load, {preempted:.0f} preemptions, "
          f"{splices} splices")
    assert splices >= len(jobs)


def report_of(client, model: str, ids: list[int], salt: str,
              params: dict | None = None) -> SpliceReport | None:
    """The connector's report in a real server's completion (``kv_transfer_params``)."""
    extra: dict = {"cache_salt": salt}
    if params is not None:
        extra["kv_transfer_params"] = params
    r = client.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0.0,
                                  extra_body=extra)
    return SpliceReport.from_params((r.model_extra or {}).get("kv_transfer_params"))


def test_vllm_returns_the_connectors_report_and_a_refused_message_splices_nothing(small,
                                                                                  smollm2):
    client, model = openai_client(small.server.url), small.server.served_name
    ids = prompt_ids(smollm2.tokenizer, [HEADER, skill_copy("refunds", OWNER), USER])
    report = report_of(client, model, ids, splice_salt("report"), leading("report"))
    assert report is not None and report.prompt_tokens == len(ids) and report.refused is None
    assert report.supplied > 0 and len(report.entries) == 2  # the header and the skill
    assert report.computed == len(ids) - report.local_hit - report.supplied
    log_start = small.server.log_path.stat().st_size
    refused = report_of(client, model, ids, "kvnotes-splice:refused",
                        {"kvnotes": {"v": 99, "ranges": []}})
    assert refused is not None and refused.loaded == () and refused.supplied == 0
    assert refused.refused == "kvnotes splice request: version 99; this kvnotes reads version 1"
    assert "its splice request was refused" in log_since(small, log_start)
    assert report_of(client, model, ids, "cold-report") is None  # an exact request: none


def test_a_skill_damaged_after_indexing_is_recomputed(small, smollm2):
    assert small.skills is not None
    client = ComposeClient(small.server.url, small.server.served_name, smollm2.tokenizer,
                           tenant="damage")
    text = ("LOST ITEMS POLICY: items left on board are kept for 30 days at the arrival "
            "airport; valuables are released only against photo identification.\n\n")
    log_start = small.server.log_path.stat().st_size
    info = small.skills.add(text, name=f"{OWNER}-lost-items")
    wait_for_rescan()
    other = client.complete([HEADER, USER], max_tokens=1)  # indexes the new skill
    assert other.ok, other.error
    path = small.skills.folder / f"{info.key}.safetensors"
    intact = path.read_bytes()
    data = bytearray(intact)
    data[-10] ^= 0xFF  # one byte of its tensors, in place: the index keeps the entry
    path.write_bytes(bytes(data))
    try:
        got = client.complete([HEADER, text, USER], max_tokens=16)
        cold = client.complete([HEADER, text, USER], max_tokens=16, salt=cold_salt())
        ids = prompt_ids(smollm2.tokenizer, [HEADER, text, USER])
        failed = report_of(openai_client(small.server.url), small.server.served_name, ids,
                           splice_salt("damage-report"), leading("damage-report"))
    finally:
        path.write_bytes(intact)  # the library is the session's: leave it readable
    assert got.ok and cold.ok, (got.error, cold.error)
    assert got.text == cold.text  # recomputed: the exact answer
    # the report says which load failed, and vLLM recomputed from there
    assert failed is not None and failed.failed and info.key in failed.entries
    assert failed.supplied < sum(len(r) for r in failed.loaded)
    log = log_since(small, log_start)
    assert f"skill '{OWNER}-lost-items'" in log and "are recomputed" in log
