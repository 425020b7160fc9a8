"""A short check of the connector's load and save on whatever device vLLM runs on (a GPU):
``python -m kvnotes_bench.gpu_check`` (``make gpu-check``).

It starts vLLM with kvnotes' connector over a fresh skills folder (SmolLM2 by default, block
16, prefix caching on), then:

1. **save**: compiles a skill by the server's own prefill (a compile request carrying a
   :class:`~kvnotes.serving.protocol.SaveRequest`) and compares the entry the connector saved
   with the engine's ``compile`` of the same ids (max abs difference of keys and values);
2. **load**: splices that entry, behind the header (compiled by the engine), into a request and
   compares its first token with the exact prompt's, and the time to first token of both.

It prints one JSON object (the figures, the device vLLM reports, ``ok``) and exits 0 when the
entry was saved, spliced, and the first tokens agree. Meant to finish in a few minutes; a
server that does not start within ``--startup-timeout`` fails it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvnotes.serving.json_types import JsonObject

HEADER = "You are the support agent of an airline. Answer in one short sentence.\n"
SKILL = ("\nBAGGAGE: each passenger may check one bag of up to 23 kg. A damaged bag is "
         "reported at the desk within 7 days; we repair or refund it. Torn handles count as "
         "damage. Keep the tag.\n")
USER = "\n\nCustomer: my bag arrived torn. What do I do?\nAgent:"


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvnotes_bench.gpu_check")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--vllm-python", default=None, help="the Python vLLM runs in")
    p.add_argument("--startup-timeout", type=float, default=420.0)
    return p.parse_args(argv)


def _entry_error(path: Path, fingerprint: Any, nb: Any) -> tuple[float, float]:
    """Max abs difference of the saved entry's keys and values from the engine's notebook."""
    from kvnotes.serving.library.manifest import read_entry

    _, keys, values = read_entry(path, fingerprint)
    dk = max(float((keys[l] - nb.keys(l)[0].transpose(0, 1).float()).abs().max())
             for l in range(len(nb.layers)))
    dv = max(float((values[l] - nb.values(l)[0].transpose(0, 1).float()).abs().max())
             for l in range(len(nb.layers)))
    return dk, dv


def _first(launch: Any, ids: list[int], extra: JsonObject) -> tuple[str, float]:
    """The first token of a greedy completion of ``ids`` and its time (s)."""
    import openai

    client = openai.OpenAI(base_url=launch.server.url + "/v1", api_key="unused", max_retries=0,
                           timeout=300)
    t0 = time.perf_counter()
    out = client.completions.create(model=launch.server.served_name, prompt=ids, max_tokens=1,
                                    temperature=0.0, extra_body=extra)
    return out.choices[0].text, time.perf_counter() - t0


def _check(launch: Any, engine: Any) -> JsonObject:
    from kvnotes.serving.library.manifest import ENTRY_SUFFIX, splice_salt
    from kvnotes.serving.planning.layout import prompt_ids
    from kvnotes.serving.protocol import SaveRequest, SpliceRequest
    from kvnotes.serving.server_prefill import EntryAddress, VllmPrefill

    skills = launch.skills
    skills.add(HEADER, name="header")
    tok = engine.tokenizer
    lead, ids = prompt_ids(tok, [HEADER]), engine.encode(SKILL)
    key = EntryAddress.of(skills.manifest, launch.model.dtype).key(ids, lead, None)
    t0 = time.perf_counter()
    VllmPrefill(launch.server.url, launch.server.served_name).prefill(
        [*lead, *ids], SaveRequest(key, len(lead), len(lead) + len(ids), "baggage"))
    figures: JsonObject = {"compile_s": time.perf_counter() - t0}
    path = skills.folder / f"{key}{ENTRY_SUFFIX}"
    figures["saved"] = path.is_file()
    if not figures["saved"]:
        return figures
    nb = engine.compile(SKILL, name="baggage", after=lead)
    figures["max_abs_dk"], figures["max_abs_dv"] = _entry_error(
        path, skills.manifest.fingerprint_obj, nb)
    time.sleep(1.0)  # the connector rescans the folder
    prompt = prompt_ids(tok, [HEADER, SKILL, USER])
    exact, figures["exact_ttft_s"] = _first(launch, prompt, {"cache_salt": "gpu-check-exact"})
    spliced, figures["spliced_ttft_s"] = _first(launch, prompt, {
        "cache_salt": splice_salt(tag="gpucheck"),
        "kv_transfer_params": SpliceRequest.leading(None, "gpucheck").to_params()})
    log = launch.server.log_path.read_text("utf-8", errors="replace")
    figures["spliced_tokens_logged"] = "spliced tokens [0, " in log
    figures["same_first_token"] = exact == spliced
    return figures


def main(argv: list[str] | None = None) -> int:
    from kvnotes.core.models import load
    from kvnotes.serving.launch.launcher import LaunchConfig, prepare

    args = _args(argv)
    root = Path(tempfile.mkdtemp(prefix="kvnotes-gpu-check-"))
    engine = load(args.model)
    config = LaunchConfig(model=args.model, skills=root / "skills", dtype=args.dtype,
                          block_size=args.block_size, max_model_len=2048,
                          vllm_python=args.vllm_python, log_path=root / "server.log",
                          startup_timeout=args.startup_timeout)
    launch = prepare(config, engine)
    t0 = time.perf_counter()
    with launch:
        figures = {"model": args.model, "dtype": args.dtype, "startup_s":
                   time.perf_counter() - t0, **_check(launch, engine)}
    log = (root / "server.log").read_text("utf-8", errors="replace")
    figures["device_cuda"] = "cuda" in log.lower()
    figures["ok"] = bool(figures.get("saved") and figures.get("spliced_tokens_logged")
                         and figures.get("same_first_token"))
    figures["log"] = str(root / "server.log")
    print(json.dumps(figures, indent=1))
    return 0 if figures["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
