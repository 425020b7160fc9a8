"""The connector on a real vLLM CPU server whose KV cache is too small for its load: spliced
requests preempted and resumed answer exactly as alone, and a skill damaged after it was
indexed is recomputed, not failed.

Its own server (40 KV blocks of 128 tokens, a 1024-token model length: settings the shared
server of test_vllm_server.py does not have). SmolLM2 in float32; 8 concurrent spliced requests
of about 460 prompt tokens (4 blocks), each in its own tenant (so no two share a block),
generating 256 tokens each with ``ignore_eos``, need 48 blocks, so vLLM preempts some and
resumes them later.
"""

from __future__ import annotations

import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvnotes.apps.agent.prompt import HEADER
from kvnotes.apps.agent.skills import skill_text
from kvnotes.core.errors import ServingError
from kvnotes.serving.compose_client import ComposeClient, cold_salt
from kvnotes.serving.launch.launcher import LaunchConfig, prepare
from kvnotes.serving.launch.process import find_vllm_python
from kvnotes.serving.planning.layout import prompt_ids

pytestmark = pytest.mark.vllm

USER = ("\n\nCustomer Mei Lin (booking C48213) writes: I booked 2 days ago and want to cancel. "
        "List every step I have to take and what I get back.\nAgent:")
SKILLS = ("refunds", "baggage", "cancellation", "compensation")
COPIES = 2
ANSWER_TOKENS = 256
KV_BLOCKS = 40


@pytest.fixture(scope="module")
def small(smollm2, tmp_path_factory):
    try:
        python = find_vllm_python()
    except ServingError as err:
        pytest.skip(f"vLLM environment absent (run `make vllm`): {err}")
    root = tmp_path_factory.mktemp("vllm-small")
    launch = prepare(LaunchConfig(model="smollm2-135m", skills=root / "skills", dtype="float32",
                                  kv_cache_gib=1, max_model_len=1024, vllm_python=str(python),
                                  log_path=root / "server.log", startup_timeout=1800,
                                  extra_args=("--num-gpu-blocks-override", str(KV_BLOCKS))),
                     smollm2)
    assert launch.skills is not None
    launch.skills.add(HEADER, name="header")
    for name in SKILLS:
        launch.skills.add(skill_text(name), name=name)
    with launch:
        yield launch


def openai_client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="kvnotes", timeout=3600, max_retries=0)


def preemptions(url: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return sum(float(m.group(1)) for m in
               re.finditer(r"^vllm:num_preemptions_total(?:\{[^}]*\})? (\S+)$", text, re.M))


def test_preempted_spliced_requests_answer_as_alone(small, smollm2):
    client = openai_client(small.url)
    prompts = [prompt_ids(smollm2.tokenizer, [HEADER, skill_text(name), USER]) for name in SKILLS]

    def complete(ids, salt):
        r = client.completions.create(
            model=small.server.served_name, prompt=ids, max_tokens=ANSWER_TOKENS,
            temperature=0.0, extra_body={"cache_salt": salt, "ignore_eos": True})
        return r.choices[0].text

    before = preemptions(small.url)
    jobs = [(i, prompts[i]) for _ in range(COPIES) for i in range(len(prompts))]
    with ThreadPoolExecutor(len(jobs)) as pool:  # a tenant each: no block is shared
        under_load = list(pool.map(lambda k: complete(jobs[k][1], f"kvnotes-splice:load-{k}"),
                                   range(len(jobs))))
    preempted = preemptions(small.url) - before
    assert preempted > 0, "no preemption: the test needs a smaller KV cache or more requests"
    # each prompt alone, in a fresh tenant namespace: spliced from scratch, never preempted
    alone = [complete(ids, f"kvnotes-splice:alone-{i}") for i, ids in enumerate(prompts)]
    wrong = [k for k, (i, _) in enumerate(jobs) if under_load[k] != alone[i]]
    assert wrong == [], f"{len(wrong)} of {len(jobs)} differ ({preempted:.0f} preemptions)"
    log = small.server.log_path.read_text("utf-8", errors="replace")
    splices = len(re.findall(r"request \S+ \(tenant load-\d+\): spliced tokens", log))
    # a resumed request is spliced again unless its blocks are still in the prefix cache
    print(f"{len(jobs)} requests, {preempted:.0f} preemptions, {splices} splices")
    assert splices >= len(jobs)


def test_a_skill_damaged_after_indexing_is_recomputed(small, smollm2):
    assert small.skills is not None
    client = ComposeClient(small.url, small.server.served_name, smollm2.tokenizer,
                           tenant="damage")
    text = ("LOST ITEMS POLICY: items left on board are kept for 30 days at the arrival "
            "airport; valuables are released only against photo identification.\n\n")
    info = small.skills.add(text, name="lost-items")
    time.sleep(1.0)  # the scheduler rescans at most every 0.25 s
    other = client.complete([HEADER, USER], max_tokens=1)  # indexes the new skill
    assert other.ok, other.error
    path = small.skills.folder / f"{info.key}.safetensors"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # one byte of its tensors, in place: the index keeps the entry
    path.write_bytes(bytes(data))
    got = client.complete([HEADER, text, USER], max_tokens=16)
    cold = client.complete([HEADER, text, USER], max_tokens=16, salt=cold_salt())
    assert got.ok and cold.ok, (got.error, cold.error)
    assert got.text == cold.text  # recomputed: the exact answer
    log = small.server.log_path.read_text("utf-8", errors="replace")
    assert "skill 'lost-items'" in log and "are recomputed" in log
