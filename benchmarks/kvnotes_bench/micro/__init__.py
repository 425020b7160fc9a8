"""Microbenchmarks, each a module run as ``python -m kvnotes_bench.micro.NAME``: compose TTFT
(``compose_ttft``), splice throughput (``splice_bandwidth``), batched decoding (``batch_decode``),
KL against the repair budget (``compose_repair``), quantized KV (``quant_fidelity``), the vLLM
splice's cost per token (``splice_cost``), the agent's prompt layouts (``agent_layouts``),
the OpenAI front's own time per request (``front_overhead``) and a learned chunk's compile
time by the compile thread's nice value, idle and beside a saturated CPU (``compile_share``)."""
