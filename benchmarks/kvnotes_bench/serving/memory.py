"""Resident memory of ``kvnotes serve``: the front's process and vLLM's process tree, idle and
after learning (a timing-free measurement, but run it alone: other processes change nothing
here except the time it takes)::

    python -m kvnotes_bench.serving.memory --model smollm2-135m --requests 8 --out mem.json

Starts ``kvnotes serve MODEL --skills TMP --learn --port P``, reads ``VmRSS`` from
``/proc/PID/status`` once the front's ``/health`` answers, sends ``--requests`` chat requests
carrying the same tool list (learned after ``learning.after`` sightings), waits ``--settle``
seconds for the learner, reads again, stops the server (SIGTERM) and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx2

TOOL = {"type": "function", "function": {
    "name": "lookup_booking", "description": "Looks a booking up by its six-letter code and "
    "returns the passenger, the flights with dates and seats, the fare and the bags allowed.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}}


def rss_mib(pid: int, tree: bool = False) -> float:
    """``VmRSS`` of ``pid`` (with every descendant when ``tree``), in MiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    kib = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))  # type: ignore[union-attr]
    if tree:
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                kib += int(rss_mib(int(child), tree=True) * 1024)
    return kib / 1024


def measure(model: str, requests: int, settle: float, port: int) -> dict[str, object]:
    cmd = [str(Path(sys.executable).with_name("kvnotes")), "serve", model, "--skills",
           tempfile.mkdtemp(prefix="kvnotes-mem-"), "--learn", "--port", str(port)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    vllm: list[int] = []

    def read_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            found = re.search(r"vLLM \(pid (\d+)\)", line)
            if found:
                vllm.append(int(found.group(1)))

    threading.Thread(target=read_stderr, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    try:
        while not vllm or httpx2.get(url + "/health", timeout=5).status_code != 200:
            if proc.poll() is not None:
                raise SystemExit(f"kvnotes serve exited with {proc.returncode}")
            time.sleep(2)
        idle = {"front_mib": rss_mib(proc.pid), "vllm_mib": rss_mib(vllm[0], tree=True)}
        for i in range(requests):
            httpx2.post(url + "/v1/chat/completions", timeout=600, json={
                "model": model, "max_tokens": 4, "temperature": 0, "tools": [TOOL],
                "messages": [{"role": "user", "content": f"Is booking ABC{i:03d} refundable?"}]})
        time.sleep(settle)
        learned = {"front_mib": rss_mib(proc.pid), "vllm_mib": rss_mib(vllm[0], tree=True)}
        stats = httpx2.get(url + "/kvnotes/stats", timeout=30).json()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    return {"model": model, "requests": requests, "settle_s": settle, "idle": idle,
            "after_learning": learned, "front_stats": stats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--settle", type=float, default=30.0)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--out", type=Path, default=Path("serve-memory.json"))
    args = parser.parse_args()
    result = measure(args.model, args.requests, args.settle, args.port)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
