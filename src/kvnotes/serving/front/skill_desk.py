"""Registering skills on a running server, and the front's readiness while it compiles them.

``POST /kvnotes/skills`` (``kvnotes skills add --server URL``) compiles skills by the server's
own prefill (:meth:`~kvnotes.serving.skills.ServingSkills.add` of a library attached to it)
and answers once their entries are written, so the next request splices them. With keys on,
it takes the operator's key only (``FrontConfig.api_key``): a tenant's key is a 401.

:class:`SkillDesk` also holds the front's readiness: ``kvnotes serve`` compiles its configured
skills (and a BOS model's start entry) once vLLM is up, and the front's ``/health`` answers
503 until they are written.
"""

from __future__ import annotations

import hmac
import threading

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvnotes.core.errors import KvnotesError
from kvnotes.serving.front.config import FrontConfig, Keys, key_digest
from kvnotes.serving.front.errors import ApiError
from kvnotes.serving.json_types import JsonObject
from kvnotes.serving.server_prefill import SaveFailed
from kvnotes.serving.skills import ServingSkills

SKILLS_PATH = "/kvnotes/skills"
MAX_SKILLS = 64  # per registration: each is one compile request to vLLM


class SkillText(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1, max_length=128)
    text: str = Field(min_length=1)


class Registration(BaseModel):
    """A registration's body: the skills, compiled behind ``header`` (text, as ``kvnotes
    serve``'s header) and, for variants, behind the registered skill ``after`` too."""

    model_config = ConfigDict(extra="forbid", strict=True)

    skills: list[SkillText] = Field(min_length=1, max_length=MAX_SKILLS)
    header: str | None = None
    after: str | None = None


class SkillDesk:
    """The registration route's work over ``skills`` (see the module docstring); ``ready``
    is set once the configured skills are written."""

    def __init__(self, skills: ServingSkills) -> None:
        self.skills = skills
        self.ready = threading.Event()
        self._lock = threading.Lock()  # one registration compiles at a time

    def authorize(self, config: FrontConfig, keys: Keys, authorization: str | None) -> None:
        """401 unless keys are off or the request carries the operator's key."""
        if not keys.enabled:
            return
        scheme, _, key = (authorization or "").partition(" ")
        if config.api_key is not None and scheme.lower() == "bearer" and hmac.compare_digest(
                key_digest(key.strip()), key_digest(config.api_key)):
            return
        raise ApiError(401, f"{SKILLS_PATH} needs the operator's key (FrontConfig.api_key, "
                       "`kvnotes serve --api-key`): send Authorization: Bearer <key>")

    def register(self, body: bytes) -> JsonObject:
        """Compile and publish the skills ``body`` names (blocking: run it off the loop);
        400 for a body it cannot read or a skill it cannot compile."""
        try:
            reg = Registration.model_validate_json(body)
        except ValidationError as err:
            first = err.errors()[0]
            raise ApiError(400, f"{SKILLS_PATH}: {first['msg']}",
                           ".".join(str(p) for p in first["loc"]) or None) from err
        with self._lock:
            try:
                after: str | list[int] | None = reg.header if reg.after is None else \
                    self.skills.after_skill(reg.after, header=reg.header)
                done = [(s.name, self.skills.add(s.text, name=s.name, after=after))
                        for s in reg.skills]
            except KvnotesError as err:
                raise ApiError(400, f"{SKILLS_PATH}: {err}") from err
            except SaveFailed as err:
                raise ApiError(502, f"{SKILLS_PATH}: {err}") from err
        return {"skills": [{"name": name, "tokens": len(info), "key": info.key}
                           for name, info in done]}
