"""``kvnotes-bench tools``: composition fidelity on public function-calling data (BFCL v4).

Each case's candidate tools are compiled as skills behind the system header and spliced in
the case's order; the tool choice read after ``{"name": "`` is compared with the exact prompt
of the same token ids and with BFCL's ground truth, strategy by strategy (``strategies``).
"""

from kvnotes.research.tool_runs import BenchResult, CaseResult, Outcome, StrategySummary
from kvnotes_bench.tools.data import SETS, HeldOutDataError, ToolCase, load_cases
from kvnotes_bench.tools.runner import ToolsBenchConfig, run_bench
from kvnotes_bench.tools.strategies import DEFAULT_STRATEGIES, Strategy, parse_strategy

__all__ = ["DEFAULT_STRATEGIES", "SETS", "ToolsBenchConfig", "BenchResult", "CaseResult",
           "HeldOutDataError", "Outcome", "Strategy", "StrategySummary", "ToolCase",
           "load_cases", "parse_strategy", "run_bench"]
