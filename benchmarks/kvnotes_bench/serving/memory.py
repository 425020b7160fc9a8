"""Resident memory of a serving host: ``kvnotes serve`` (its front and vLLM's process tree) idle
and after learning ``--tools`` tools, against plain vLLM alone on the same model and dtype::

    python -m kvnotes_bench.serving.memory --model qwen2.5-coder-1.5b --dtype float32 \\
        --tools 20 --out docs/results/serve-memory/qwen2.5-coder-1.5b-float32.json

1. plain vLLM (:func:`kvnotes.serving.launch.launcher.prepare` without skills or front), its
   process tree's ``VmRSS`` once healthy;
2. ``kvnotes serve MODEL --dtype D --skills TMP --learn --port P``: both once the front's
   ``/health`` answers, then after chats carrying BFCL ``live_multiple`` development tools (4
   per chat, each chat sent ``learning.after`` + 1 times) once the learner has compiled
   ``--tools`` entries or ``--settle`` seconds have passed.

A timing-free measurement (other processes change only how long it takes); the JSON keeps the
date, the command and the machine.
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
from typing import Any

import httpx2

from kvnotes_bench.kit.machine import MachineRecord


def rss_mib(pid: int, tree: bool = False) -> float:
    """``VmRSS`` of ``pid`` (with every descendant when ``tree``), in MiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    kib = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))  # type: ignore[union-attr]
    if tree:
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                kib += int(rss_mib(int(child), tree=True) * 1024)
    return kib / 1024


def tool_chats(n_tools: int, per_chat: int = 4) -> list[list[dict[str, Any]]]:
    """The first ``n_tools`` distinct BFCL ``live_multiple`` development tools, ``per_chat``
    to a tool list."""
    from kvnotes_bench.serving.agent_traffic_requests import tool_pool, tool_requests
    from kvnotes_bench.tools.data import load_cases

    pool = tool_pool(tool_requests(load_cases("live_multiple"), min_tools=1))[:n_tools]
    return [pool[i:i + per_chat] for i in range(0, len(pool), per_chat)]


def plain_vllm_mib(model: str, dtype: str) -> float:
    """Plain vLLM's process tree, healthy and idle."""
    from kvnotes.serving.launch.launcher import LaunchConfig, prepare

    with prepare(LaunchConfig(model=model, dtype=dtype)) as launch:
        assert launch.server.pid is not None
        return rss_mib(launch.server.pid, tree=True)


def _learned(url: str) -> int:
    stats = httpx2.get(url + "/kvnotes/stats", timeout=30).json()
    return int((stats.get("learner") or {}).get("learned_entries", 0))


def serve_mib(model: str, dtype: str, n_tools: int, settle: float, port: int
              ) -> dict[str, Any]:
    """``kvnotes serve``'s front and vLLM, idle and after learning (see the module docstring)."""
    cmd = [str(Path(sys.executable).with_name("kvnotes")), "serve", model, "--dtype", dtype,
           "--skills", tempfile.mkdtemp(prefix="kvnotes-mem-"), "--learn", "--port", str(port)]
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
        for i, tools in enumerate(tool_chats(n_tools)):
            for _ in range(3):  # learning.after (2) sightings, then one that can splice
                httpx2.post(url + "/v1/chat/completions", timeout=900, json={
                    "model": model, "max_tokens": 4, "temperature": 0, "tools": tools,
                    "messages": [{"role": "user", "content": f"Which tool answers query {i}?"}]})
        deadline = time.monotonic() + settle
        while _learned(url) < n_tools and time.monotonic() < deadline:
            time.sleep(2)
        learned = {"front_mib": rss_mib(proc.pid), "vllm_mib": rss_mib(vllm[0], tree=True)}
        stats = httpx2.get(url + "/kvnotes/stats", timeout=30).json()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    return {"serve_command": cmd, "idle": idle, "after_learning": learned,
            "learned_entries": int((stats.get("learner") or {}).get("learned_entries", 0)),
            "front_stats": stats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tools", type=int, default=20)
    parser.add_argument("--settle", type=float, default=600.0)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--out", type=Path, default=Path("serve-memory.json"))
    args = parser.parse_args()
    machine = MachineRecord.now()
    alone = plain_vllm_mib(args.model, args.dtype)
    served = serve_mib(args.model, args.dtype, args.tools, args.settle, args.port)
    machine.finish()
    after = served["after_learning"]
    total = after["front_mib"] + after["vllm_mib"]
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python -m kvnotes_bench.serving.memory " + " ".join(sys.argv[1:]),
        "model": args.model, "dtype": args.dtype, "tools": args.tools,
        "vllm_alone_mib": alone, **served,
        "goals": {"front_under_512_mib": after["front_mib"] < 512,
                  "total_over_vllm_alone": total / alone - 1,
                  "total_within_10_percent": total <= 1.10 * alone},
        "machine": machine.to_dict()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "front_stats"}, indent=1))


if __name__ == "__main__":
    main()
