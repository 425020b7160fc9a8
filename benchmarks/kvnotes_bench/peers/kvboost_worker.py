"""kvboost's side of the peers benchmark: a worker in ``.venv-peers`` (``make peers``).

It imports only torch, transformers and kvboost (never kvnotes), reads one JSON request a line
on stdin and answers one JSON line on stdout; everything else it prints goes to stderr.

- ``{"op": "load", "model_dir", "threads", "methods": {name: InferenceEngine keywords}}``:
  one float32 model and tokenizer from the folder, one kvboost engine per method on it;
- ``{"op": "run", "method", "prompt", "warm": [texts], "max_new_tokens"}``: the engine's
  cache cleared (``reset_cache``), each warm text cached with ``warm()`` (untimed), then one
  ``generate`` of the prompt: its greedy tokens, the seconds to the first one (from the call,
  by its ``on_token`` callback: tokenizing, assembling and seam repair included), the tokens
  it served from cache and every token the model was fed before the first one came out;
- ``{"op": "encode", "text"}``: the ids ``generate`` uses for a prompt;
- ``{"op": "rss"}``: this process's peak resident memory (MiB).
"""

from __future__ import annotations

import importlib.metadata
import json
import resource
import sys
import time
from typing import Any

import torch

MAX_CACHE_BYTES = 1_500_000_000  # the cache of kvboost's own published benchmarks (1.5 GB)


class Worker:
    def __init__(self) -> None:
        self.engines: dict[str, Any] = {}
        self.fed = 0
        self.counting = False

    def load(self, model_dir: str, threads: int, methods: dict[str, dict[str, Any]]) -> dict[str, Any]:
        from kvboost import KVBoost  # type: ignore[import-not-found]  # in .venv-peers only
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if tokenizer.pad_token is None:  # what KVBoost.from_pretrained does
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        model.register_forward_pre_hook(self._count, with_kwargs=True)
        self.tokenizer = tokenizer
        for name, kwargs in methods.items():
            self.engines[name] = KVBoost(model, tokenizer, device="cpu",
                                         max_cache_bytes=MAX_CACHE_BYTES, **kwargs)
        return {"methods": sorted(self.engines), "torch_threads": torch.get_num_threads(),
                "kvboost_version": importlib.metadata.version("kvboost")}

    def _count(self, _module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if self.counting and ids is not None:
            self.fed += int(ids.shape[-1])

    def run(self, method: str, prompt: str, warm: list[str], max_new_tokens: int) -> dict[str, Any]:
        from kvboost import GenerationMode

        engine = self.engines[method]
        engine.reset_cache()
        for text in warm:
            engine.warm(text)
        first: list[float] = []
        tokens: list[int] = []
        self.fed, self.counting = 0, True

        def on_token(token: int) -> None:
            if not first:
                first.append(time.perf_counter())
                self.counting = False
            tokens.append(int(token))

        t0 = time.perf_counter()
        result = engine.generate(prompt, max_new_tokens=max_new_tokens,
                                 mode=GenerationMode.CHUNK_KV_REUSE, on_token=on_token)
        self.counting = False
        return {"ttft_s": first[0] - t0, "text": result.output_text, "tokens": tokens,
                "prompt_tokens": result.prompt_tokens, "reused": result.cached_tokens,
                "fed": self.fed}

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.pop("op")
        if op == "load":
            return self.load(**req)
        if op == "run":
            return self.run(**req)
        if op == "encode":
            return {"ids": self.tokenizer.encode(req["text"], add_special_tokens=True)}
        if op == "rss":
            return {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        raise ValueError(f"unknown op {op!r}")


def main() -> None:
    out, sys.stdout = sys.stdout, sys.stderr  # the protocol owns stdout
    worker = Worker()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = {"ok": True, **worker.handle(json.loads(line))}
        except Exception as e:  # the caller reports it; the worker keeps serving
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
