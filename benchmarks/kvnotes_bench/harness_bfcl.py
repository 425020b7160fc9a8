"""``kvnotes-bench bfcl-harness``: BFCL's own harness against plain vLLM and ``kvnotes serve``.

The Berkeley Function Calling Leaderboard publishes its evaluation harness (``bfcl-eval``): its
``bfcl generate`` sends each case to an OpenAI-compatible endpoint with its own client and its
own prompt format, and ``bfcl evaluate`` scores the answers (AST checking). Here it runs, in its
own environment (``make bfcl-harness``: ``.venv-bfcl``, offline, the model read from its local
folder), against two servers of the same weights in turn:

- ``vllm``: plain vLLM (prefix caching on), the exact reference;
- ``kvnotes``: ``kvnotes serve --learn`` (vLLM with kvnotes' connector behind its front), sent
  the same cases ``passes`` times, each pass scored. With ``register_tools``, each tool's text
  in the prompts BFCL sent to vLLM (its input log; :func:`prompt_tool_texts`) is first
  registered as a skill on the running server (``POST /kvnotes/skills``), so the front finds
  and splices them in BFCL's completion texts.

BFCL has no Qwen2.5-Coder entry. Its Qwen prompting handler (``Qwen/Qwen3-1.7B``, the default)
lists the functions as JSON in BFCL's system prompt and parses ``[func(arg=value)]`` answers,
which Qwen2.5-Coder-1.5B writes. Its Qwen FC handler (``--handler Qwen/Qwen3-1.7B-FC``) writes
the Hermes-style ``<tools>`` prompt and parses ``<tool_call>`` answers, which the 1.5B does not
write (bare JSON: AST 0 on both servers); the tool texts of either are registered.
Its OSS handlers send a raw text prompt to ``/v1/completions`` (never a chat with ``tools``), so
kvnotes splices there only what its front finds in a completion text: registered skills (it
learns chunks on sight from chats, which BFCL's handlers never send).

Categories: report-only (nothing here chooses a setting); ``multiple`` is held out and refused.
The first ``per_category`` ids of each category are listed in the result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvnotes.core.errors import InvalidArgumentError, ServingError
from kvnotes.serving.json_types import JsonObject, JsonValue
from kvnotes_bench.kit.machine import MachineRecord

HELD_OUT = frozenset({"multiple"})
REPORT_CATEGORIES = ("simple_python", "parallel", "live_simple", "live_multiple")
SERVERS = ("vllm", "kvnotes")


@dataclass(frozen=True)
class HarnessConfig:
    """One harness run (see the module docstring)."""

    model: str = "qwen2.5-coder-1.5b"
    categories: tuple[str, ...] = ("live_simple", "live_multiple")
    per_category: int = 20
    handler: str = "Qwen/Qwen3-1.7B"
    passes: int = 2
    register_tools: bool = True
    bfcl_python: str = ".venv-bfcl/bin/python"
    kv_cache_gib: int = 2
    max_model_len: int = 4096

    def __post_init__(self) -> None:
        for c in self.categories:
            if c in HELD_OUT:
                raise InvalidArgumentError(f"BFCL category {c!r} is held out and never run")
            if c not in REPORT_CATEGORIES:
                raise InvalidArgumentError(f"category {c!r}: use one of "
                                           f"{', '.join(REPORT_CATEGORIES)}")
        if self.per_category <= 0 or self.passes <= 0:
            raise InvalidArgumentError("per_category and passes must be positive")


def bfcl_data_root(bfcl_python: str) -> Path:
    """The ``data`` folder of the bfcl-eval installed in the harness's environment."""
    code = "import bfcl_eval, pathlib; print(pathlib.Path(bfcl_eval.__file__).parent / 'data')"
    out = subprocess.run([bfcl_python, "-c", code], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def first_ids(root: Path, category: str, n: int) -> list[str]:
    """The first ``n`` case ids of a report category (only the ``id`` field is kept)."""
    if category in HELD_OUT:
        raise InvalidArgumentError(f"BFCL category {category!r} is held out and never read")
    ids: list[str] = []
    with (root / f"BFCL_v4_{category}.json").open(encoding="utf-8") as f:
        for line in f:
            if line.strip() and len(ids) < n:
                ids.append(str(json.loads(line)["id"]))
    return ids


@dataclass
class Scored:
    """``bfcl evaluate``'s figures for one server and category."""

    category: str
    accuracy: float
    correct: int
    total: int
    failed_ids: list[str] = field(default_factory=list)


@dataclass
class ServerRun:
    """One server's pass: BFCL's scores, each case's raw answer, the front's counters."""

    server: str
    wall_s: float
    scores: list[Scored]
    answers: dict[str, str]
    front_stats: JsonObject | None = None


def _bfcl(config: HarnessConfig, root: Path, url: str, folder: Path, *args: str) -> None:
    env = dict(os.environ, BFCL_PROJECT_ROOT=str(root), REMOTE_OPENAI_BASE_URL=url + "/v1",
               REMOTE_OPENAI_API_KEY="EMPTY", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [str(Path(config.bfcl_python).absolute()), "-m", "bfcl_eval", *args]
    log = root / "bfcl.log"
    with log.open("a", encoding="utf-8") as f:
        done = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, check=False,
                              cwd=folder.parent)
    if done.returncode != 0:
        raise ServingError(f"{' '.join(cmd)} exited {done.returncode}; see {log}")


def run_pass(config: HarnessConfig, server: str, url: str, folder: Path, ids: Mapping[str, list[str]],
             root: Path) -> ServerRun:
    """``bfcl generate`` then ``bfcl evaluate`` for ``ids`` against ``url``, in ``root`` (each
    answer's row keeps the prompt BFCL sent: ``--include-input-log``)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "test_case_ids_to_generate.json").write_text(json.dumps(dict(ids)), "utf-8")
    t0 = time.perf_counter()
    _bfcl(config, root, url, folder, "generate", "--model", config.handler, "--run-ids",
          "--skip-server-setup", "--local-model-path", folder.name, "--num-threads", "1",
          "--allow-overwrite", "--include-input-log")
    wall = time.perf_counter() - t0
    _bfcl(config, root, url, folder, "evaluate", "--model", config.handler,
          "--test-category", ",".join(ids), "--partial-eval")
    return ServerRun(server, wall, list(read_scores(root)), dict(read_answers(root)))


def _json_lines(path: Path) -> Iterator[dict[str, Any]]:
    for line in path.read_text("utf-8").splitlines():
        if line.strip():
            yield json.loads(line)


def read_scores(root: Path) -> Iterator[Scored]:
    """Each category's score file under ``root/score`` (first line: the summary)."""
    for path in sorted((root / "score").rglob("*_score.json")):
        rows = list(_json_lines(path))
        head = rows[0]
        category = path.name.removeprefix("BFCL_v4_").removesuffix("_score.json")
        yield Scored(category, float(head["accuracy"]), int(head["correct_count"]),
                     int(head["total_count"]), [str(r["id"]) for r in rows[1:] if "id" in r])


# BFCL's prompting system prompt ("Here is a list of functions in json format that you can
# invoke.\n"), right before the functions' list as ``json.dumps(functions, indent=4)``
_FUNCTIONS_HEAD = " format that you can invoke.\n"


def prompt_tool_texts(prompt: str) -> list[str]:
    """The text each tool is written as in one prompt BFCL sent: a line of its ``<tools>`` block
    (FC handlers), else the lines of its object in the JSON list the prompting handlers' system
    prompt lists the functions in (from the line ``    {`` to its ``    }``)."""
    if "<tools>\n" in prompt:  # the block itself: the prompt names the tags in a sentence before it
        block = prompt.partition("<tools>\n")[2].partition("\n</tools>")[0]
        return [line for line in block.splitlines() if line.startswith("{")]
    rest = prompt.partition(_FUNCTIONS_HEAD)[2]
    if not rest.startswith("["):
        return []
    try:
        end = json.JSONDecoder().raw_decode(rest)[1]
    except ValueError:
        return []
    texts: list[str] = []
    start: int | None = None
    lines = rest[:end].splitlines()
    for i, line in enumerate(lines):
        if line == "    {":
            start = i
        elif start is not None and line in ("    }", "    },"):
            texts.append("\n".join([*lines[start:i], "    }"]))
            start = None
    return texts


def tool_texts(root: Path) -> list[str]:
    """Each tool's text in the prompts BFCL sent (:func:`prompt_tool_texts`; its input log under
    ``root/result``), once each, in order."""
    seen: dict[str, None] = {}
    for path in sorted((root / "result").rglob("*_result.json")):
        for row in _json_lines(path):
            for entry in row.get("inference_log") or []:
                prompt = str((entry.get("content") or {}).get("formatted_prompt", ""))
                seen.update((text, None) for text in prompt_tool_texts(prompt))
    return list(seen)


def register_tools(url: str, texts: Sequence[str]) -> int:
    """Register each tool text as a skill on a running ``kvnotes serve`` (``POST
    /kvnotes/skills``, compiled by its vLLM), 32 per call; the number registered."""
    import hashlib

    from kvnotes.serving.vllm_endpoints import Client

    client = Client(url, timeout=1800.0)
    for at in range(0, len(texts), 32):
        batch: list[JsonValue] = [
            {"name": "bfcl-" + hashlib.sha256(t.encode()).hexdigest()[:16], "text": t}
            for t in texts[at:at + 32]]
        status, body = client.request("POST", "/kvnotes/skills", {"skills": batch})
        if status != 200:
            raise ServingError(f"POST /kvnotes/skills answered {status}: {body[:300]!r}")
    return len(texts)


def read_answers(root: Path) -> Iterator[tuple[str, str]]:
    """Each case's raw answer under ``root/result``."""
    for path in sorted((root / "result").rglob("*_result.json")):
        for row in _json_lines(path):
            yield str(row["id"]), json.dumps(row.get("result"), sort_keys=True)


@contextmanager
def plain_vllm(config: HarnessConfig, log: Path) -> Iterator[str]:
    """A plain vLLM server (no connector) of ``config.model``."""
    from kvnotes.serving.launch.launcher import LaunchConfig, prepare

    launch = prepare(LaunchConfig(model=config.model, kv_cache_gib=config.kv_cache_gib,
                                  max_model_len=config.max_model_len, log_path=log))
    with launch:
        yield launch.url


@contextmanager
def kvnotes_server(config: HarnessConfig, out: Path) -> Iterator[str]:
    """``kvnotes serve MODEL --learn`` as a user starts it, on a free port."""
    from kvnotes.serving.launch.process import free_port

    port = free_port()
    settings = out / "serve.toml"
    settings.write_text(f'log = "{out / "kvnotes-vllm.log"}"\n', "utf-8")
    cmd = [str(Path(sys.executable).parent / "kvnotes"), "serve", config.model, "--learn",
           "--skills", str(out / "skills"), "--port", str(port), "--config", str(settings),
           "--kv-cache-gib", str(config.kv_cache_gib), "--max-model-len",
           str(config.max_model_len)]
    url = f"http://127.0.0.1:{port}"
    with (out / "front.log").open("w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_health(url, proc, timeout_s=1200.0)
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=120)


def _wait_health(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    from kvnotes.serving.vllm_endpoints import Client

    client, deadline = Client(url, timeout=10.0), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServingError(f"kvnotes serve exited {proc.returncode} before it was healthy")
        if client.healthy():
            return
        time.sleep(3.0)
    raise ServingError(f"kvnotes serve at {url} was not healthy within {timeout_s:.0f} s")


def front_stats(url: str) -> JsonObject | None:
    """The front's ``/kvnotes/stats`` (what it spliced and learned), None when unreadable."""
    from kvnotes.serving.vllm_endpoints import Client

    try:
        return Client(url, timeout=10.0).get_object("/kvnotes/stats")
    except (ServingError, OSError, ValueError):
        return None


@dataclass
class HarnessResult:
    """Both servers' runs, the cases whose answers differ, and where it ran."""

    config: dict[str, Any]
    ids: dict[str, list[str]]
    runs: list[ServerRun]
    machine: dict[str, Any]
    command: str
    date: str
    differing: list[str] = field(default_factory=list)
    registered_tools: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def differing(a: ServerRun, b: ServerRun) -> list[str]:
    """Case ids whose raw answers differ between two runs (or that one of them lacks)."""
    return sorted(i for i in set(a.answers) | set(b.answers)
                  if a.answers.get(i) != b.answers.get(i))


def run_harness(config: HarnessConfig, out: Path, command: str) -> HarnessResult:
    """Every pass of both servers (see the module docstring)."""
    from kvnotes.serving.launch.launcher import LaunchConfig, export_model

    if not Path(config.bfcl_python).exists():
        raise InvalidArgumentError(f"{config.bfcl_python} is missing: run `make bfcl-harness`")
    machine = MachineRecord.now()
    root = bfcl_data_root(config.bfcl_python)
    ids = {c: first_ids(root, c, config.per_category) for c in config.categories}
    out = out.absolute()  # bfcl runs in another folder
    # BFCL sends its --local-model-path as the model's name: a link named as both servers
    # serve the model (LaunchConfig.name), read from the folder BFCL runs in
    out.mkdir(parents=True, exist_ok=True)
    folder = out / "models" / LaunchConfig(model=config.model).name
    folder.parent.mkdir(exist_ok=True)
    if not folder.is_symlink():
        folder.symlink_to(export_model(config.model).folder, target_is_directory=True)
    runs: list[ServerRun] = []
    registered = 0
    with plain_vllm(config, out / "vllm.log") as url:
        runs.append(run_pass(config, "vllm", url, folder, ids, out / "bfcl-vllm"))
    with kvnotes_server(config, out) as url:
        if config.register_tools:
            registered = register_tools(url, tool_texts(out / "bfcl-vllm"))
        for n in range(config.passes):
            run = run_pass(config, f"kvnotes-pass{n + 1}", url, folder, ids,
                           out / f"bfcl-kvnotes-{n + 1}")
            run.front_stats = front_stats(url)
            runs.append(run)
    machine.finish()
    return HarnessResult(asdict(config), ids, runs, machine.to_dict(), command,
                         time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                         differing(runs[0], runs[-1]), registered)


def summary_lines(result: HarnessResult) -> Sequence[str]:
    """One line per server pass and category, then the differing cases."""
    lines = []
    for run in result.runs:
        for s in run.scores:
            lines.append(f"{run.server:16s} {s.category:15s} {s.correct}/{s.total} "
                         f"({100 * s.accuracy:.1f}%)  generate {run.wall_s:.0f} s")
        if run.front_stats is not None:
            lines.append(f"{run.server:16s} front (cumulative): requests "
                         f"{run.front_stats.get('requests')}, outcomes "
                         f"{run.front_stats.get('outcomes')}, forwarded "
                         f"{run.front_stats.get('forwarded')}")
    lines.append(f"answers differing (vllm vs last kvnotes pass): {len(result.differing)}"
                 + (f": {', '.join(result.differing)}" if result.differing else ""))
    return lines
