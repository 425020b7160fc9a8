"""``kvnotes-bench serve soak``: the connector under load, every answer checked.

Its options' defaults are :class:`~kvnotes_bench.serving.soak_workload.SoakConfig`'s (and
:class:`~kvnotes_bench.serving.corun.CorunConfig`'s), read from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from kvnotes.cli.app import emit_json
from kvnotes.cli.options import default_of
from kvnotes_bench.cli.app import invocation
from kvnotes_bench.cli.serve_bench import (
    AsJson,
    Dtype,
    Model,
    Out,
    RequestTimeout,
    ServerOptions,
    StartupTimeout,
    VllmPython,
    Written,
    bench_app,
    say,
)
from kvnotes_bench.serving.corun import CorunConfig
from kvnotes_bench.serving.soak_workload import SoakConfig


def _soak(name: str) -> Any:
    """A default of :class:`SoakConfig`: the option's."""
    return default_of(SoakConfig, name)


@dataclass(frozen=True)
class SoakCommand:
    """What ``serve-bench soak`` runs: the soak's config, the launched server's options, and the
    co-running measurement after it (None: skipped)."""

    bench: SoakConfig
    server: ServerOptions
    corun: CorunConfig | None = None
    how: str = ""

    def __post_init__(self) -> None:
        if self.server.url:
            raise typer.BadParameter("serve-bench soak launches its own server (a small KV "
                                     "cache, a skill folder it damages on purpose): drop --url")

    def run(self) -> Written:
        """Run it and write the bundle in ``--out``."""
        import kvnotes
        from kvnotes_bench.serving.soak import run_soak
        from kvnotes_bench.serving.soak_report import write_outputs

        engine = kvnotes.load(self.server.model)
        self.server.out.mkdir(parents=True, exist_ok=True)
        target = self.server.target(max_model_len=self.bench.max_model_len)
        assert target.launch is not None  # __post_init__ refused --url
        result = run_soak(self.bench, target.launch, engine, out=self.server.out,
                          corun=self.corun, request_timeout_s=self.server.request_timeout,
                          how=self.how, say=say)
        data = result.to_dict()
        return data, write_outputs(data, self.server.out)


@bench_app.command("soak")
def soak(
    model: Model = _soak("model"),
    duration: Annotated[float, typer.Option("--duration", help="Seconds the clients keep "
                                            "sending")] = _soak("duration_s"),
    clients: Annotated[int, typer.Option("--clients", help="Concurrent clients")] = _soak("clients"),
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Greedy tokens per answer, "
                                            "each checked against the engine")] = _soak("max_tokens"),
    exact_fraction: Annotated[float, typer.Option("--exact-fraction")] = _soak("exact_fraction"),
    volatile_fraction: Annotated[float, typer.Option(
        "--volatile-fraction", help="Requests carrying the volatile skill of the moment")] = (
        _soak("volatile_fraction")),
    disconnect_fraction: Annotated[float, typer.Option(
        "--disconnect-fraction", help="Requests whose stream is closed after 1-3 chunks")] = (
        _soak("disconnect_fraction")),
    event_interval: Annotated[float, typer.Option(
        "--event-interval", help="Seconds between volatile skills (each published, damaged, "
        "retired)")] = _soak("event_interval_s"),
    block_size: Annotated[int, typer.Option("--block-size", help="KV block size (tokens, a "
                                            "multiple of 32)")] = _soak("block_size"),
    kv_blocks: Annotated[int, typer.Option(
        "--kv-blocks", help="KV cache size in blocks: small, so vLLM preempts")] = _soak("kv_blocks"),
    seed: Annotated[int, typer.Option("--seed")] = _soak("seed"),
    corun: Annotated[bool, typer.Option(
        "--corun", help="Then measure a streamed request's inter-token latency beside spliced "
        "requests, beside the same prompts sent exactly, and alone")] = False,
    corun_seconds: Annotated[float, typer.Option("--corun-seconds",
                                                 help="Seconds per co-running mode")] = (
        default_of(CorunConfig, "seconds")),
    dtype: Dtype = "float32", startup_timeout: StartupTimeout = 900.0,
    vllm_python: VllmPython = None, request_timeout: RequestTimeout = 300.0,
    out: Out = Path("out/serve-bench/soak"), as_json: AsJson = False,
) -> None:
    """The connector under load: concurrent clients, preemption, skills published, deleted and
    corrupted while requests use them, early disconnects; every answer checked against
    kvnotes' engine."""
    from kvnotes_bench.serving.soak_report import markdown

    server = ServerOptions(launch=True, model=model, dtype=dtype, kv_cache_gib=1,
                           startup_timeout=startup_timeout, vllm_python=vllm_python,
                           request_timeout=request_timeout, out=out)
    interval = event_interval
    bench = SoakConfig(model=model, duration_s=duration, clients=clients, max_tokens=max_tokens,
                       exact_fraction=exact_fraction, volatile_fraction=volatile_fraction,
                       disconnect_fraction=disconnect_fraction, event_interval_s=interval,
                       damage_after_s=0.4 * interval, retire_after_s=0.8 * interval,
                       block_size=block_size, kv_blocks=kv_blocks, seed=seed)
    how = invocation()
    data, paths = SoakCommand(bench=bench, server=server, how=how,
                              corun=CorunConfig(seconds=corun_seconds, background=max(
                                  1, clients - 1)) if corun else None).run()
    if as_json:
        emit_json({k: v for k, v in data.items() if k != "requests"})
    else:
        typer.echo(markdown(data))
        typer.echo(f"\nwrote {paths['json']}, {paths['report']}, {paths['plot']}")


