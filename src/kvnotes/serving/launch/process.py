"""A vLLM OpenAI-compatible server as a child process in its own virtual environment.

:class:`VLLMServer` runs vLLM's OpenAI entry point on a model folder with the basic settings
(port, dtype, context length, KV cache size) and whatever extra arguments it is given;
:mod:`kvnotes.serving.launch.launcher` exports the model, adds the connector and is where servers are
started from. The server runs as a child process on 127.0.0.1 with prefix caching on. It is stopped by its
own process id (and the ids of the processes it started, recorded while it ran) when the
``with`` block ends, on error, on Ctrl-C and on SIGTERM. Errors carry the tail of its log.
"""

from __future__ import annotations

import atexit
import math
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from kvnotes.core.errors import InvalidArgumentError, ServingError
from kvnotes.serving.vllm_endpoints import Client

VLLM_PYTHON_ENV = "KVNOTES_VLLM_PYTHON"
VLLM_KEEP_ALIVE_S = 30
_REPO_ROOT = Path(__file__).resolve().parents[4]  # src/kvnotes/serving/launch/process.py -> checkout


def find_vllm_python(explicit: str | Path | None = None) -> Path:
    """The Python of the vLLM environment: ``explicit``, ``$KVNOTES_VLLM_PYTHON``, or
    ``.venv-vllm`` in the current folder or the kvnotes checkout (``make vllm`` creates it)."""
    candidates: list[Path] = []
    if explicit:
        candidates.append(Path(explicit))
    elif os.environ.get(VLLM_PYTHON_ENV):
        candidates.append(Path(os.environ[VLLM_PYTHON_ENV]))
    else:
        candidates += [Path.cwd() / ".venv-vllm" / "bin" / "python",
                       _REPO_ROOT / ".venv-vllm" / "bin" / "python"]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    tried = ", ".join(str(c) for c in candidates)
    raise ServingError(f"no vLLM environment found (looked for {tried}): run `make vllm` to "
                       f"create .venv-vllm, or point --vllm-python / ${VLLM_PYTHON_ENV} at the "
                       "Python of an environment with vLLM installed")


def check_kv_cache_gib(gib: float) -> int:
    """``gib`` as the whole number of GiB vLLM's CPU build accepts (it reads
    ``VLLM_CPU_KVCACHE_SPACE`` with ``int()``, so 0.1 would fail minutes into the start).

    Example:
        >>> check_kv_cache_gib(2.0)
        2
    """
    if (isinstance(gib, bool) or not isinstance(gib, (int, float)) or not math.isfinite(gib)
            or gib != int(gib) or gib < 1):
        raise InvalidArgumentError(
            f"kv_cache_gib {gib!r}: vLLM's CPU build takes its KV cache size in whole GiB "
            "(VLLM_CPU_KVCACHE_SPACE is read with int()); pass a whole number of at least 1, "
            "e.g. --kv-cache-gib 1")
    return int(gib)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _descendants(pid: int) -> list[int]:
    seen, stack = [], [pid]
    while stack:
        for child in _children(stack.pop()):
            if child not in seen:
                seen.append(child)
                stack.append(child)
    return seen


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat: tells a process from a later one that reuses its id."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return fields[19] if len(fields) > 19 and fields[0] != "Z" else None


def tail(path: Path | None, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file ("" when there is none)."""
    if path is None or not path.is_file():
        return ""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 64_000))
        text = f.read().decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


class VLLMServer:
    """A vLLM OpenAI-compatible server started as a child process.

    Example:
        >>> with VLLMServer("/path/to/hf-dir", served_name="smollm2-135m") as srv:  # doctest: +SKIP
        ...     print(srv.url)
    """

    def __init__(self, model_dir: str | Path, *, served_name: str, port: int | None = None,
                 python: str | Path | None = None, log_path: str | Path | None = None,
                 prefix_caching: bool = True, max_model_len: int = 4096,
                 dtype: str = "bfloat16", kv_cache_gib: int = 2,
                 extra_args: Sequence[str] = (), env: dict[str, str] | None = None,
                 module: str = "vllm.entrypoints.openai.api_server",
                 startup_timeout: float = 900.0) -> None:
        self.model_dir = Path(model_dir)
        self.served_name = served_name
        self.port = port or free_port()
        self.python = find_vllm_python(python) if module.startswith("vllm") else Path(python or "")
        self.log_path = Path(log_path) if log_path else Path(
            os.environ.get("TMPDIR", "/tmp")) / f"kvnotes-vllm-{self.port}.log"
        self.cmd = [str(self.python), "-m", module, "--model", str(self.model_dir),
                    "--served-model-name", served_name, "--host", "127.0.0.1",
                    "--port", str(self.port), "--dtype", dtype,
                    "--max-model-len", str(max_model_len), "--enable-prompt-tokens-details",
                    "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
                    *extra_args]
        self.kv_cache_gib = check_kv_cache_gib(kv_cache_gib)
        # vLLM's HTTP keep-alive outlasts every client's idle expiry (httpx and the openai SDK:
        # 5 s, the front's pool: 2 s), so a client never reuses a connection the server is
        # closing at that moment (the request would fail with no response); an operator's own
        # setting wins.
        # vLLM 0.32's CPU build saves its AOT-compiled model but cannot load it back ("'function'
        # object has no attribute 'finalize_loading'"), so every start compiled the model again;
        # without AOT, inductor's own cache is reused. An operator's own setting wins.
        self.env = {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(VLLM_KEEP_ALIVE_S),
                    "VLLM_USE_AOT_COMPILE": "0", **os.environ,
                    "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
                    "PYTHONUNBUFFERED": "1", **(env or {})}
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None
        self._known: dict[int, str | None] = {}  # pid -> start time, for every process seen
        self._old_sigterm: object = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.log_path, lines)

    def _error(self, message: str) -> ServingError:
        return ServingError(f"{message}\n--- last lines of the server log {self.log_path} ---\n"
                            f"{self.log_tail() or '(empty)'}")

    def start(self) -> VLLMServer:
        """Start the process (returns at once; see :meth:`wait_ready`)."""
        if self.proc is not None:
            raise ServingError("this server was already started")
        if not self.model_dir.is_dir():
            raise ServingError(f"model folder {self.model_dir} does not exist")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env)
        finally:
            log.close()
        self._known[self.proc.pid] = _start_time(self.proc.pid)
        atexit.register(self.stop)
        return self

    def _remember_children(self) -> None:
        if self.proc is None:
            return
        for pid in _descendants(self.proc.pid):
            if pid not in self._known:
                self._known[pid] = _start_time(pid)

    def wait_ready(self, timeout: float | None = None, poll: float = 2.0) -> float:
        """Block until ``/health`` answers and the model is listed; returns seconds waited.

        Raises :class:`ServingError` with the log tail if the process exits or ``timeout``
        passes (the server is then stopped).
        """
        if self.proc is None:
            raise ServingError("start() the server before waiting for it")
        timeout = self.startup_timeout if timeout is None else timeout
        client, t0 = Client(self.url, timeout=30), time.monotonic()
        while True:
            self._remember_children()
            rc = self.proc.poll()
            if rc is not None:
                raise self._error(f"the vLLM server exited with code {rc} while starting "
                                  f"(command: {' '.join(self.cmd)})")
            if client.healthy(timeout=5):
                served = client.models()
                if self.served_name not in served:
                    self.stop()
                    raise self._error(f"the server is up but serves {served}, "
                                      f"not {self.served_name!r}")
                self._remember_children()
                self.startup_s = time.monotonic() - t0
                return self.startup_s
            if time.monotonic() - t0 > timeout:
                self.stop()
                raise self._error(f"the vLLM server did not become healthy within {timeout:.0f} s")
            time.sleep(poll)

    def alive_pids(self) -> list[int]:
        """Processes of this server (the main one and those it started) still running."""
        return [pid for pid, st in self._known.items()
                if st is not None and _start_time(pid) == st]

    def stop(self, timeout: float = 60.0) -> bool:
        """Stop the server by its process id (SIGTERM, then SIGKILL), then any process it had
        started that outlived it. True when none of them is left."""
        if self.proc is None:
            return True
        self._remember_children()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        deadline = time.monotonic() + 15
        while self.alive_pids() and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in self.alive_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
        return not self.alive_pids()

    def __enter__(self) -> VLLMServer:
        if threading.current_thread() is threading.main_thread():
            # SIGTERM becomes KeyboardInterrupt, so that __exit__ stops the server
            self._old_sigterm = signal.signal(signal.SIGTERM, _sigterm_to_interrupt)
        try:
            self.start()
            self.wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            if self._old_sigterm is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)  # type: ignore[arg-type]
                self._old_sigterm = None


def _sigterm_to_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
