"""The erratum's wording and place (serve-bench --errata append|latest|follow-up), on one block-32
server, run alone on the machine (session 6), in two parts:

1. errata-followup-b32-c1-8k: the timing row of issue 15's goal (8k context, concurrency 1, the
   decision question, 6 sessions x 3 edits) for in-place and the follow-up erratum, whose
   question is cached from the previous request, so it computes only the correction and a short
   re-ask (the append form of the same row is matrix-b32-c1, session 3). 3 edits, not 4: a
   fourth would take the follow-up prompt past what serve-bench lets an 8k context use on an
   8192-token server (it counts 48 template tokens and the answer).
2. errata-{append,latest,follow-up}-b32: the status question (the field's value itself) after
   each of 3 edits, 8 sessions per context, 1k/4k/8k, the erratum policy alone: does the model
   read the latest edit in each form? An accuracy run.
3. errata-followup-b32-c16-8k: the follow-up erratum at concurrency 16, on its own server.
4. errata-follow-up-latest-b32 and errata-followup-latest-b32-c1-8k: the follow-up-latest form,
   on its own server (`serve_errata.py errata-follow-up-latest-b32,errata-followup-latest-b32-c1-8k`).

Run from the repository root: `python benchmarks/serve_quiet/serve_errata.py [NAMES]`."""
import sys

from block32_runner import run_configs

STATUS = dict(context_tokens=(1000, 4000, 8000), policies=("erratum",), sessions=8,
              requests_per_row=24, question="status", max_tokens=24)
RUNS = [("errata-followup-b32-c1-8k", dict(context_tokens=(8000,),
                                           policies=("in-place", "erratum"),
                                           errata="follow-up", sessions=6,
                                           requests_per_row=18))]
RUNS += [(f"errata-{form}-b32", dict(STATUS, errata=form))
         for form in ("append", "latest", "follow-up")]
# 3. the concurrency-16 row of the goal for the follow-up erratum (16 sessions x 1 edit, as the
#    append form's matrix-b32-c16), run on its own server afterwards
# 4. follow-up-latest (the question cached, one correction from the context's value to the
#    current one), added after parts 1-3 showed follow-up right after the first edit and
#    latest right after later ones: the status question as in part 2, and its timing row at
#    8k (erratum only; the in-place row of part 1 is its reference)
RUNS += [("errata-follow-up-latest-b32", dict(STATUS, errata="follow-up-latest")),
         ("errata-followup-latest-b32-c1-8k", dict(context_tokens=(8000,), policies=("erratum",),
                                                   errata="follow-up-latest", sessions=6,
                                                   requests_per_row=18))]
RUNS += [("errata-followup-b32-c16-8k", dict(context_tokens=(8000,), policies=("erratum",),
                                             errata="follow-up", concurrency=(16,),
                                             sessions=16, edits=1))]
if len(sys.argv) > 1:  # names of the configs to run (default: all, in order)
    RUNS = [r for r in RUNS if r[0] in sys.argv[1].split(",")]
HOW = ("benchmarks/serve_quiet/serve_errata.py: one block-32 server, configs run in sequence, "
       "nothing else on the machine")
run_configs(RUNS, server_dir="server-errata", kv_cache_gib=8, how=HOW, concurrency=(1,),
            edits=3)
