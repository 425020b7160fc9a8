"""vLLM serving benchmark: does the append-only erratum keep a production prefix cache aligned?

``kvnotes serve-bench`` (see :mod:`kvnotes.cli.serve`) starts or reaches a vLLM server, sends
sessions of long contexts with streams of field edits under three policies (in-place, erratum,
cold) and reports TTFT, prefix-cache hit rate, throughput and decision agreement.
"""

from kvnotes.apps.serving.bench import BenchConfig, markdown_table, run_benchmark, write_outputs
from kvnotes.apps.serving.client import Client, StreamResult, check_loopback_url
from kvnotes.apps.serving.export import export_hf_dir
from kvnotes.apps.serving.metrics import PrefixCacheCounters, parse_prometheus, percentile
from kvnotes.apps.serving.server import VLLMServer, find_vllm_python
from kvnotes.apps.serving.workload import (
    POLICIES,
    Session,
    make_session,
    make_sessions,
)
from kvnotes.core.errors import ServingError

__all__ = [
    "BenchConfig", "Client", "POLICIES", "PrefixCacheCounters", "ServingError", "Session",
    "StreamResult", "VLLMServer", "check_loopback_url", "export_hf_dir",
    "find_vllm_python", "make_session", "make_sessions", "markdown_table",
    "parse_prometheus", "percentile", "run_benchmark", "write_outputs",
]
