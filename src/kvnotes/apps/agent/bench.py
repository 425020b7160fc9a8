"""agent-bench: the kvnotes agent against the recompute agent over scripted episodes.

Per turn, both agents (and the stale-record ablation) take the same request and events,
interleaved so that they run under the same machine load. Reported: decision identity overall
and per turn, the flips with their cases, latency per turn and in total, the latency ratio,
and tokens computed by each agent.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvnotes.apps.agent.episodes import Episode, scripted_episode, scripted_episodes
from kvnotes.apps.agent.runtime import KvnotesAgent, RecomputeAgent, TurnResult
from kvnotes.apps.agent.skills import SkillBook
from kvnotes.core.engine import Engine
from kvnotes.core.machine import machine_info
from kvnotes.eval.reports import write_bundle

WARM_UP_EPISODE = 10_000  # an episode no run measures


def run_bench(engine: Engine, episodes: Sequence[Episode] | None = None, *, n_episodes: int = 40,
              turns: int = 5, first_episode: int = 0, tool_calls: bool = False, stale: bool = True,
              skill_root: str | Path | None = None, guard: float | None = None,
              anchored: bool = True, variants: bool = True, history: int | None = 0,
              order: str = "request",
              repair: float | int = 0, carry_record: bool = True,
              progress: Callable[[str], None] | None = None,
              on_episode: Callable[[dict[str, Any]], None] | None = None,
              on_skill: Callable[[int, int, str, bool], None] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the JSON-ready result (see :func:`write_outputs`).

    ``on_episode`` receives the summary of the episodes done so far after each episode (the
    CLI writes it out, so an interrupted run still leaves its figures). ``on_skill`` follows
    the skill library's preparation (:meth:`KvnotesAgent.prepare`'s ``progress``), which takes
    minutes the first time a layout with variants runs on a model. ``guard``,
    ``anchored``, ``variants``, ``repair`` and ``carry_record`` configure the kvnotes agent
    (see :class:`KvnotesAgent`); ``history`` and ``order`` the prompt of both agents (see
    :mod:`kvnotes.apps.agent.prompt`). ``first_episode``: run the scripted episodes from this
    one on (a held-out range to choose settings on). The result's ``settings`` records them.
    """
    episodes = (list(episodes) if episodes is not None
                else scripted_episodes(n_episodes, turns, first=first_episode))
    settings = {"order": order, "history": history, "anchored": anchored, "variants": variants,
                "guard": guard, "repair": repair, "carry_record": carry_record,
                "episodes": [ep.episode_id for ep in episodes]}
    machine_before = machine_info()  # latency ratios mean little without the load beside them
    book = SkillBook(engine, skill_root)
    misses0 = book.library.misses
    layout = {"history": history, "order": order}
    agents = {"kvnotes": KvnotesAgent(engine, book, tool_calls=tool_calls, guard=guard,
                                      anchored=anchored, variants=variants, repair=repair,
                                      carry_record=carry_record, **layout),
              "recompute": RecomputeAgent(engine, book, tool_calls=tool_calls, **layout)}
    if stale:
        agents["stale"] = KvnotesAgent(engine, book, updates="ignore", tool_calls=False,
                                       anchored=anchored, variants=variants, **layout)
    t0 = time.perf_counter()
    for agent in agents.values():  # every splice compiled (or loaded) before any turn
        if isinstance(agent, KvnotesAgent):
            agent.prepare(progress=on_skill)
    prepare_s = time.perf_counter() - t0
    # one untimed turn each first: a fresh process's first forwards are slower (allocator,
    # kernel set-up), and the first episode would carry that for one agent more than the other
    warm = scripted_episode(WARM_UP_EPISODE, 1)
    for agent in agents.values():
        agent.start(warm.state)
        agent.turn(warm.turns[0].request, warm.turns[0].events)
    records: list[dict[str, Any]] = []

    def summary() -> dict[str, Any]:  # the figures of the episodes done so far
        return {"settings": settings, **summarize(
            engine, records, book=book, prepare_s=prepare_s,
            compiled=book.library.misses - misses0, tool_calls=tool_calls)}

    for i, ep in enumerate(episodes):
        for agent in agents.values():
            agent.start(ep.state)
        rows: dict[str, list[TurnResult]] = {name: [] for name in agents}
        events_so_far: list[list[str]] = []
        for turn in ep.turns:
            events_so_far += [[e.field, e.value] for e in turn.events]
            for name, agent in agents.items():
                rows[name].append(agent.turn(turn.request, turn.events))
            records.append({
                "episode": ep.episode_id, "turn": len(rows["kvnotes"]) - 1,
                "kind": turn.request.kind, "request": turn.request.text,
                "events_so_far": list(events_so_far),
                **{name: r[-1].to_dict() for name, r in rows.items()},
            })
        if progress:
            k = sum(r.latency_s for r in rows["kvnotes"])
            c = sum(r.latency_s for r in rows["recompute"])
            same = sum(a.decision.answer == b.decision.answer
                       for a, b in zip(rows["kvnotes"], rows["recompute"], strict=True))
            progress(f"[{i + 1}/{len(episodes)}] {ep.episode_id}: identical {same}/{len(ep.turns)}"
                     f"  kvnotes {k:.2f}s  recompute {c:.2f}s  ({c / k:.1f}x)")
        if on_episode:
            on_episode(summary())
    result = summary()
    result["machine"] = {"before": machine_before, "after": machine_info(since=machine_before)}
    return result


def _machine_line(machine: dict[str, Any] | None) -> str:
    if not machine:
        return ""
    b, a = machine["before"], machine["after"]
    # "after" is busy when other work took CPU time during the run (cpu_use); the load average
    # after a run counts the run's own threads, so it is only reported
    busy = " (busy: latency ratios are contaminated)" if b["busy"] or a["busy"] else ""
    use = a.get("cpu_use")
    other = (f"; other work took {100 * use['other_share']:.1f}% of the CPUs during the run "
             f"(steal {100 * use['steal_share']:.1f}%)" if use else "")
    return (f" {b['torch_threads']} torch threads; load average {b['load_average'][0]} before, "
            f"{a['load_average'][0]} after{other}{busy}.")


def _settings_line(settings: dict[str, Any] | None) -> str:
    if not settings:
        return ""
    eps = settings["episodes"]
    shown = f"{eps[0]}..{eps[-1]}" if len(eps) > 1 else (eps[0] if eps else "none")
    agent = ", ".join(f"{k} {settings[k]}" for k in ("order", "history", "variants", "guard",
                                                      "repair", "carry_record"))
    return f" Episodes {shown}; {agent}."


def _mean(xs: Sequence[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def summarize(engine: Engine, records: list[dict[str, Any]], *, book: SkillBook,
              prepare_s: float, compiled: int, tool_calls: bool) -> dict[str, Any]:
    """Aggregate per-turn records into the benchmark's figures."""
    turns = sorted({r["turn"] for r in records})
    same = [r["kvnotes"]["choice"] == r["recompute"]["choice"] for r in records]
    flips = [{
        "episode": r["episode"], "turn": r["turn"], "kind": r["kind"],
        "kvnotes": r["kvnotes"]["choice"], "recompute": r["recompute"]["choice"],
        "kvnotes_margin": r["kvnotes"]["margin"], "recompute_margin": r["recompute"]["margin"],
        "recompute_scores": r["recompute"]["scores"], "kvnotes_scores": r["kvnotes"]["scores"],
        "events_so_far": r["events_so_far"],
    } for r, s in zip(records, same, strict=True) if not s]
    per_turn = []
    for t in turns:
        rs = [r for r in records if r["turn"] == t]
        k = [r["kvnotes"]["latency_s"] for r in rs]
        c = [r["recompute"]["latency_s"] for r in rs]
        per_turn.append({
            "turn": t, "n": len(rs),
            "identity": _mean([r["kvnotes"]["choice"] == r["recompute"]["choice"] for r in rs]),
            "kvnotes_latency_s": _mean(k), "recompute_latency_s": _mean(c),
            "ratio": sum(c) / sum(k) if sum(k) else float("nan"),
            "kvnotes_tokens_computed": _mean([r["kvnotes"]["tokens_computed"] for r in rs]),
            "recompute_tokens_computed": _mean([r["recompute"]["tokens_computed"] for r in rs]),
            "flop_ratio": _ratio(sum(r["recompute"].get("flops", 0.0) for r in rs),
                                 sum(r["kvnotes"].get("flops", 0.0) for r in rs)),
            **({"stale_identity": _mean([r["stale"]["choice"] == r["recompute"]["choice"]
                                         for r in rs])} if "stale" in rs[0] else {}),
        })
    total_k = sum(r["kvnotes"]["latency_s"] for r in records)
    total_c = sum(r["recompute"]["latency_s"] for r in records)
    out: dict[str, Any] = {
        "model": engine.name, "episodes": len({r["episode"] for r in records}),
        "turns_per_episode": len(turns), "decisions": len(records),
        "identity": _mean(same), "flip_count": len(flips), "flips": flips,
        "per_turn": per_turn,
        "latency": {"kvnotes_total_s": total_k, "recompute_total_s": total_c,
                    "ratio": total_c / total_k if total_k else float("nan"),
                    "kvnotes_mean_turn_s": _mean([r["kvnotes"]["latency_s"] for r in records]),
                    "recompute_mean_turn_s": _mean([r["recompute"]["latency_s"]
                                                    for r in records])},
        "tokens": {
            "kvnotes_computed": sum(r["kvnotes"]["tokens_computed"] for r in records),
            "kvnotes_reused": sum(r["kvnotes"]["tokens_reused"] for r in records),
            "recompute_computed": sum(r["recompute"]["tokens_computed"] for r in records),
        },
        "compute": compute_stats(records),
        "recompute_margin_median": statistics.median(r["recompute"]["margin"] for r in records),
        "guard": guard_stats(records),
        "fast_margin_error": margin_error_stats(records),
        "guard_sweep": guard_sweep(records) if any(r["kvnotes"].get("guard")
                                                   for r in records) else None,
        "skills": {"names": book.names, "tokens": {n: len(book.token_ids(n)) for n in book.names},
                   "compiled_now": compiled, "library_hits": book.library.hits,
                   "prepare_s": prepare_s},
        "tool_calls": tool_calls,
        "records": records,
    }
    if records and "stale" in records[0]:
        changed = [r for r in records if r["events_so_far"]]
        out["stale"] = {
            "identity": _mean([r["stale"]["choice"] == r["recompute"]["choice"] for r in records]),
            "identity_after_state_change": _mean([r["stale"]["choice"] == r["recompute"]["choice"]
                                                  for r in changed]),
            "kvnotes_identity_after_state_change": _mean(
                [r["kvnotes"]["choice"] == r["recompute"]["choice"] for r in changed]),
            "decisions_after_state_change": len(changed),
        }
    if tool_calls:
        calls = [r for r in records if r["recompute"]["tool_call"] or r["kvnotes"]["tool_call"]]
        out["tool_call_stats"] = {
            "turns_with_a_call": len(calls),
            "kvnotes_valid": sum(bool(r["kvnotes"]["tool_call"] and r["kvnotes"]["tool_call"]["ok"])
                                 for r in calls),
            "recompute_valid": sum(bool(r["recompute"]["tool_call"]
                                        and r["recompute"]["tool_call"]["ok"]) for r in calls),
            "identical_raw": sum(bool(r["kvnotes"]["tool_call"] and r["recompute"]["tool_call"]
                                      and r["kvnotes"]["tool_call"]["raw"]
                                      == r["recompute"]["tool_call"]["raw"]) for r in calls),
        }
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def compute_stats(records: list[dict[str, Any]]) -> dict[str, float]:
    """The arithmetic each agent did (:mod:`kvnotes.core.work`) and the latency ratio it allows:
    on a compute-bound machine the latency ratio cannot beat the FLOP ratio by much, so the
    FLOP ratio is the workload's ceiling and latency ÷ FLOP ratio is how much of it is kept."""
    k = sum(r["kvnotes"].get("flops", 0.0) for r in records)
    c = sum(r["recompute"].get("flops", 0.0) for r in records)
    guard = sum(r["kvnotes"].get("guard_flops", 0.0) for r in records)
    guard_s = sum(r["kvnotes"]["guard"]["seconds"] for r in records
                  if r["kvnotes"].get("guard") and r["kvnotes"]["guard"]["fired"])
    lat_k = sum(r["kvnotes"]["latency_s"] for r in records)
    lat_c = sum(r["recompute"]["latency_s"] for r in records)
    return {"kvnotes_flops": k, "recompute_flops": c, "guard_flops": guard,
            "flop_ratio": _ratio(c, k), "fast_flop_ratio": _ratio(c, k - guard),
            "fast_latency_ratio": _ratio(lat_c, lat_k - guard_s),
            "kept": _ratio(_ratio(lat_c, lat_k), _ratio(c, k))}


def fast_margin_errors(records: list[dict[str, Any]]) -> list[float]:
    """Per decision, how far the fast (unguarded) decision's margin is from recompute's: the
    fast margin counts positive when the fast choice is recompute's, negative otherwise, and
    the error is its distance from recompute's margin (exact for two options; with three, the
    runner-ups may differ). 0 on turns whose notes were all exact."""
    out = []
    for r in records:
        k, c = r["kvnotes"], r["recompute"]
        g = k.get("guard")
        answer, margin = (g["fast_answer"], g["fast_margin"]) if g else (k["choice"], k["margin"])
        signed = margin if answer == c["choice"] else -margin
        out.append(abs(signed - c["margin"]))
    return out


def margin_error_stats(records: list[dict[str, Any]]) -> dict[str, float]:
    errors = sorted(fast_margin_errors(records))
    return {"median": statistics.median(errors), "p90": errors[int(0.9 * (len(errors) - 1))],
            "max": errors[-1], "under_0.001": sum(e < 1e-3 for e in errors)}


SWEEP_TAUS = (1.0, 0.75, 0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1, 0.05, 0.0)


def guard_sweep(records: list[dict[str, Any]], taus: Sequence[float] = SWEEP_TAUS
                ) -> list[dict[str, float]]:
    """What a lower guard threshold would have cost, read off a run's records (an estimate, not
    a run): a fire whose fast margin is at or above ``tau`` is dropped with its recompute time
    and FLOPs, and a fast flip it caught is counted as missed. Thresholds above the run's own
    are not estimated (the fires they add were never run). After a dropped fire the notes
    would have stayed inexact, so later turns could differ from the run's."""
    run_tau = next(r["kvnotes"]["guard"]["tau"] for r in records if r["kvnotes"].get("guard"))
    rec_s = sum(r["recompute"]["latency_s"] for r in records)
    rec_f = sum(r["recompute"].get("flops", 0.0) for r in records)
    out = []
    for tau in taus:
        if tau > run_tau:
            continue
        kv_s = sum(r["kvnotes"]["latency_s"] for r in records)
        kv_f = sum(r["kvnotes"].get("flops", 0.0) for r in records)
        fired = missed = 0
        for r in records:
            g = r["kvnotes"]["guard"]
            if not g["fired"]:
                continue
            if g["fast_margin"] < tau:
                fired += 1
            else:
                kv_s -= g["seconds"]
                kv_f -= r["kvnotes"].get("guard_flops", 0.0)
                missed += g["fast_answer"] != r["recompute"]["choice"]
        out.append({"tau": tau, "fired": fired, "missed_flips": missed,
                    "latency_ratio": _ratio(rec_s, kv_s), "flop_ratio": _ratio(rec_f, kv_f)})
    return out


def guard_stats(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """How often the kvnotes agent's decision guard fired, what it caught and what it cost."""
    guards = [r["kvnotes"].get("guard") for r in records]
    if not any(guards):
        return None
    fired = [g for g in guards if g and g["fired"]]
    return {
        "tau": next(g["tau"] for g in guards if g), "decisions": len(guards),
        "fired": len(fired), "fired_rate": len(fired) / len(guards),
        "changed": sum(g["changed"] for g in fired),  # re-decisions that differ from the fast one
        "tokens": sum(g["tokens"] for g in fired),
        "seconds": sum(g["seconds"] for g in fired),  # included in the kvnotes latency
        "would_flip_without": sum(
            g["fast_answer"] != r["recompute"]["choice"] for g, r in zip(guards, records,
                                                                         strict=True) if g),
    }


def write_outputs(result: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write ``agent-bench.json``, ``report.md`` and ``latency.png`` into ``out_dir``."""
    return write_bundle(out_dir, result, report=report_markdown(result),
                        json_name="agent-bench.json", plot_name="latency.png",
                        plot=lambda path: plot_latency(result, path))


def plot_latency(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [p["turn"] + 1 for p in result["per_turn"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(turns, [p["recompute_latency_s"] for p in result["per_turn"]], "o-",
            label="recompute agent")
    ax.plot(turns, [p["kvnotes_latency_s"] for p in result["per_turn"]], "s-",
            label="kvnotes agent (splice + valid-prefix reuse)")
    ax.set_xlabel("turn")
    ax.set_ylabel("mean latency per turn (s)")
    ax.set_yscale("log")
    ax.set_xticks(turns)
    ax.set_title(f"{result['model']}: {result['episodes']} episodes, "
                 f"ratio {result['latency']['ratio']:.1f}x")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report_markdown(result: dict[str, Any]) -> str:
    lat, tok = result["latency"], result["tokens"]
    lines = [
        f"# agent-bench: {result['model']}", "",
        f"{result['episodes']} scripted episodes x {result['turns_per_episode']} turns = "
        f"{result['decisions']} decisions (tool calls: {'on' if result['tool_calls'] else 'off'})."
        + _machine_line(result.get("machine")) + _settings_line(result.get("settings")),
        "", "## Summary", "",
        "| figure | value |", "| --- | --- |",
        f"| decision identity with recompute | {result['identity']:.1%} "
        f"({result['decisions'] - result['flip_count']}/{result['decisions']}) |",
        f"| flips | {result['flip_count']} |",
        f"| total latency, recompute agent | {lat['recompute_total_s']:.2f} s |",
        f"| total latency, kvnotes agent | {lat['kvnotes_total_s']:.2f} s |",
        f"| latency ratio (recompute / kvnotes) | {lat['ratio']:.2f}x |",
        f"| tokens computed, recompute agent | {tok['recompute_computed']} |",
        f"| tokens computed, kvnotes agent | {tok['kvnotes_computed']} "
        f"(reused {tok['kvnotes_reused']}) |",
        f"| median decision margin, recompute (log-prob) | "
        f"{result['recompute_margin_median']:.3f} |",
        f"| skills compiled this run / library hits | {result['skills']['compiled_now']} / "
        f"{result['skills']['library_hits']} ({result['skills']['prepare_s']:.1f} s, "
        "not in any turn) |",
    ]
    if result.get("guard"):
        g = result["guard"]
        lines += [
            f"| decision guard (tau = {g['tau']}) fired | {g['fired']} of {g['decisions']} "
            f"({g['fired_rate']:.1%}); changed the decision {g['changed']} times |",
            f"| guard cost (in the kvnotes latency) | {g['tokens']} tokens recomputed, "
            f"{g['seconds']:.2f} s |",
            f"| decisions the fast (unguarded) choice would have flipped | "
            f"{g['would_flip_without']} |",
        ]
    comp = result.get("compute")
    if comp and comp["kvnotes_flops"]:
        fast = (f" (fast path, without the guard's recomputes: {comp['fast_flop_ratio']:.1f}x "
                f"FLOPs, {comp['fast_latency_ratio']:.1f}x latency)" if comp["guard_flops"] else "")
        lines += [
            f"| arithmetic, recompute / kvnotes (the latency ratio a compute-bound machine "
            f"allows) | {comp['recompute_flops'] / 1e12:.1f} / {comp['kvnotes_flops'] / 1e12:.1f}"
            f" TFLOP: {comp['flop_ratio']:.1f}x{fast} |",
            f"| latency ratio / FLOP ratio (how much of the arithmetic saving the latency "
            f"keeps) | {comp['kept']:.2f} |",
        ]
    err = result.get("fast_margin_error")
    if err:
        lines.append(f"| fast decision's margin error vs recompute (log-prob): median / p90 / max |"
                     f" {err['median']:.3f} / {err['p90']:.3f} / {err['max']:.3f} "
                     f"({err['under_0.001']} decisions on exact notes) |")
    if "stale" in result:
        s = result["stale"]
        lines += [
            f"| identity after a state change: kvnotes (record rewritten) | "
            f"{s['kvnotes_identity_after_state_change']:.1%} of "
            f"{s['decisions_after_state_change']} |",
            f"| identity after a state change: stale record (changes ignored, ablation) | "
            f"{s['identity_after_state_change']:.1%} |",
        ]
    if "tool_call_stats" in result:
        t = result["tool_call_stats"]
        lines.append(f"| tool calls: valid kvnotes / recompute / identical raw, of "
                     f"{t['turns_with_a_call']} | {t['kvnotes_valid']} / {t['recompute_valid']}"
                     f" / {t['identical_raw']} |")
    lines += ["", "## Per turn", "",
              "| turn | n | identity | recompute s | kvnotes s | ratio | FLOP ratio | "
              "recompute tokens | kvnotes tokens |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in result["per_turn"]:
        flop = p.get("flop_ratio", float("nan"))
        lines.append(f"| {p['turn'] + 1} | {p['n']} | {p['identity']:.1%} | "
                     f"{p['recompute_latency_s']:.3f} | {p['kvnotes_latency_s']:.3f} | "
                     f"{p['ratio']:.1f}x | {'-' if flop != flop else f'{flop:.1f}x'} | "
                     f"{p['recompute_tokens_computed']:.0f} | "
                     f"{p['kvnotes_tokens_computed']:.0f} |")
    if result.get("guard_sweep"):
        lines += ["", "## Lower guard thresholds, read off this run", "",
                  "An estimate, not a run: a fire whose fast margin is at or above tau is dropped"
                  " with its time and FLOPs; after it the notes would have stayed inexact, so "
                  "later turns could differ.", "",
                  "| tau | fired | flips it would miss | latency ratio | FLOP ratio |",
                  "| --- | --- | --- | --- | --- |"]
        for row in result["guard_sweep"]:
            lines.append(f"| {row['tau']} | {row['fired']} | {row['missed_flips']} | "
                         f"{row['latency_ratio']:.1f}x | {row['flop_ratio']:.1f}x |")
    lines += ["", "![latency per turn](latency.png)", "", "## Flips", ""]
    if not result["flips"]:
        lines.append("None: every decision matched the recompute agent.")
    else:
        lines += ["| episode | turn | request | kvnotes | recompute | recompute margin | "
                  "state changes so far |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for f in result["flips"]:
            events = ", ".join(f"{a}={b}" for a, b in f["events_so_far"]) or "none"
            lines.append(f"| {f['episode']} | {f['turn'] + 1} | {f['kind']} | {f['kvnotes']} | "
                         f"{f['recompute']} | {f['recompute_margin']:.3f} | {events} |")
    lines += ["", "Latency: time from a request (with its pending state changes) to the decision"
              " (and tool call when on), measured per turn with both agents interleaved. Skill "
              "compilation happens once per model, before the episodes, and is not in any turn; "
              "each agent takes one untimed warm-up turn before the first episode.",
              ""]
    return "\n".join(lines)
