"""A compose agent: precompiled skills spliced in, every still-valid note reused (a state change
rewrites the record from the changed field on), decisions guarded by their margin; and the
recompute agent it is measured against, reading the same prompt.

Example:
    >>> from kvnotes.apps.agent import (AgentConfig, KvnotesAgent, SkillBook, run_episode,
    ...                                 scripted_episode)
    >>> engine = kvnotes.load("smollm2-135m")                                 # doctest: +SKIP
    >>> episode = scripted_episode(0, turns=2)
    >>> agent = KvnotesAgent(engine, SkillBook(engine), AgentConfig(guard=0.25))  # doctest: +SKIP
    >>> results = run_episode(agent, episode.state, episode.turns)            # doctest: +SKIP

    (:class:`KvnotesAgent` shows the same on a throwaway skill folder, run as a test.)
"""

from kvnotes.apps.agent.config import AgentConfig
from kvnotes.apps.agent.episodes import (
    Episode,
    Request,
    Turn,
    request,
    route,
    scripted_episode,
    scripted_episodes,
)
from kvnotes.apps.agent.prompt import Prompt
from kvnotes.apps.agent.runtime import (
    Agent,
    KvnotesAgent,
    RecomputeAgent,
    TurnResult,
    choose,
    run_episode,
)
from kvnotes.apps.agent.skills import SkillBook, skill_names, skill_text
from kvnotes.apps.agent.state import FIELDS, Event, State
from kvnotes.apps.agent.toolcall import TOOLS, ToolCall, parse_tool_call
from kvnotes.core.chat import ChatFormat
from kvnotes.core.errors import UnknownSkillError
from kvnotes.ops.decisions import Decision

__all__ = [
    "Episode", "Request", "Turn", "request", "route", "scripted_episode", "scripted_episodes",
    "ChatFormat", "Prompt",
    "AgentConfig", "Agent", "Decision", "KvnotesAgent", "RecomputeAgent", "TurnResult", "choose",
    "run_episode",
    "SkillBook", "UnknownSkillError", "skill_names", "skill_text",
    "FIELDS", "Event", "State", "TOOLS", "ToolCall", "parse_tool_call",
]
