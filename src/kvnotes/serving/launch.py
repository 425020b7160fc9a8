"""Start vLLM with kvnotes' connector: the model exported, the skills folder prepared.

:func:`compose_server` is what ``kvnotes serve`` and the skills benchmark use: it checks the
model can be spliced exactly (before anything starts), writes the serving manifest, exports a
vLLM-ready copy of the model, and returns a :class:`VLLMServer` whose command line loads
:class:`~kvnotes.serving.connector.KvnotesConnector` with prefix caching on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvnotes.core.engine import Engine
from kvnotes.core.machine import cpu_flags
from kvnotes.serving.connector_path import SOURCE_ROOT
from kvnotes.serving.export import export_hf_dir
from kvnotes.serving.server import VLLMServer
from kvnotes.serving.skills import ServingSkills

CONNECTOR_CLASS = "KvnotesConnector"
CONNECTOR_MODULE = "kvnotes.serving.connector"


def cpu_dtype() -> str:
    """bfloat16 where the CPU computes it natively (avx512_bf16 / amx_bf16), else float32
    (RECIPES.md: bf16 without native support is several times slower)."""
    native_bf16 = {"avx512_bf16", "amx_bf16"} & set(cpu_flags())
    return "bfloat16" if native_bf16 else "float32"


def kv_transfer_config(skills_folder: Path, *, max_gib: float = 2.0) -> dict[str, Any]:
    return {"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"skills": str(skills_folder), "max_gib": max_gib}}


def compose_server(engine: Engine, model: str, skills_root: str | os.PathLike[str], *,
                   dtype: str = "auto", block_size: int | None = None,
                   max_model_len: int = 4096, kv_cache_gib: float = 2.0,
                   port: int | None = None, python: str | None = None,
                   log_path: str | os.PathLike[str] | None = None,
                   startup_timeout: float = 900.0) -> tuple[VLLMServer, ServingSkills]:
    """A (not yet started) vLLM server for ``model`` that splices the skills under
    ``skills_root``, and the :class:`ServingSkills` to register skills with (also while it
    runs). Raises :class:`~kvnotes.UnsupportedModelError` at once for a model whose keys
    cannot be moved exactly."""
    skills = ServingSkills(skills_root, engine)  # checks the scheme, writes the manifest
    served_dtype = cpu_dtype() if dtype == "auto" else dtype
    folder = export_hf_dir(model, dtype=served_dtype)
    extra = ["--kv-transfer-config", json.dumps(kv_transfer_config(skills.folder))]
    if block_size:
        extra += ["--block-size", str(block_size)]
    # the server's Python imports kvnotes from this checkout (it lives in another venv)
    env = {"PYTHONPATH": os.pathsep.join(
        p for p in (str(SOURCE_ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    name = model if not Path(model).exists() else Path(model).stem
    server = VLLMServer(folder, served_name=name, python=python, port=port, log_path=log_path,
                        max_model_len=max_model_len, dtype=served_dtype,
                        kv_cache_gib=kv_cache_gib, extra_args=extra, env=env,
                        startup_timeout=startup_timeout)
    return server, skills
