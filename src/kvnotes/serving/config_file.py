"""``kvnotes serve``'s settings, declared once: :class:`ServeConfig`.

The same model reads a config file (``kvnotes serve --config FILE``, TOML or YAML), holds what
the command line gives, and is what the launch is built from (:meth:`ServeConfig.front_config`,
:meth:`ServeConfig.launch_config`). Its sections are the library configs' own fields, with their
types, defaults, checks and descriptions, not written again:

- top level: the model, the skill library, where the server listens and what vLLM runs with;
- ``[limits]``: :class:`~kvnotes.serving.front.config.FrontConfig`'s bounds and timeouts;
- ``[auth]``: its keys and tenant;
- ``[learning]``: ``enabled`` and :class:`~kvnotes.serving.front.config.LearnConfig`'s fields;
- ``[store]``: the shared Redis store (``url``, ``password_file``, ``mirror_bytes``).

:data:`FLAGS` names the settings the command line takes (the command's options are generated
from it and from the fields' descriptions); every setting is the file's. A key the model does
not have is refused with its name and the file's path. ``examples/serve.toml`` lists every key.

Example:
    >>> cfg = load_serve_config(given={"skills": "skills", "learning.enabled": True,
    ...                                "learning.after": 3})
    >>> cfg.learn_config().after, cfg.front_config().learn.after
    (3, 3)
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeAlias

import yaml  # type: ignore[import-untyped]
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    model_validator,
)
from pydantic.fields import FieldInfo

from kvnotes.core.errors import InvalidArgumentError, KvnotesError, UnsafePathError
from kvnotes.serving.front.config import FrontConfig, LearnConfig, front_repair
from kvnotes.serving.launch.launcher import DTYPES, LaunchConfig
from kvnotes.serving.launch.process import check_kv_cache_gib

# The settings ``kvnotes serve`` takes on its command line, by key, with their option (the
# most used ones; the command has at most 15 parameters). Every other setting is the file's.
FLAGS: dict[str, str] = {
    "skills": "--skills", "port": "--port", "host": "--host", "auth.api_key": "--api-key",
    "auth.key_file": "--key-file", "learning.enabled": "--learn", "store.url": "--store",
    "dtype": "--dtype", "repair": "--repair", "guard": "--guard",
    "max_model_len": "--max-model-len", "kv_cache_gib": "--kv-cache-gib",
    "no_front": "--no-front",
}
# Secrets an operator may keep out of files and argv: the environment sets them (over the
# file; an option on the command line wins over both).
ENV: dict[str, str] = {"auth.api_key": "KVNOTES_API_KEY",
                       "auth.metrics_key": "KVNOTES_METRICS_KEY"}

# FrontConfig's fields by section: each key of a section is the field of the same name
LIMITS = ("timeout", "request_timeout", "connect_timeout", "discover_timeout", "body_timeout",
          "head_timeout", "keep_alive_s", "plan_timeout", "max_body_bytes", "max_drain_bytes",
          "max_header_bytes", "max_json_depth", "max_concurrent", "max_connections",
          "max_connections_per_ip", "backlog", "upstream_connections", "plan_workers",
          "max_plans_per_client", "part_cache_chars", "max_tools", "max_tool_depth",
          "max_messages", "max_content_parts", "max_prompt_tokens")
AUTH = ("api_key", "key_file", "metrics_key", "tenant", "upstream_api_key")
STORE = {"url": "store", "password_file": "store_password_file", "mirror_bytes": "mirror_bytes"}
# FrontConfig's fields the file does not set: the launcher fills them in (the server it
# starts), or a top-level setting spells them (repair "K@F", guard)
FRONT_FILLED = ("upstream", "block_size", "model", "port", "host", "repair", "guard", "learn",
                "store", "store_password_file", "mirror_bytes")


class _Section(BaseModel):
    """A table of the file: unknown keys refused, values fixed once read."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class _LearningSection(_Section):
    enabled: Annotated[bool, Field(description=(
        "Learn the chunks requests carry (each tools entry, each text content part): compiled "
        "in the background once seen `after` times per tenant, then spliced; no request waits "
        "for a compile"))] = False


def _section(title: str, fields: Mapping[str, FieldInfo], keys: Mapping[str, str],
             base: type[_Section] = _Section) -> type[_Section]:
    """A section whose ``keys`` are the given fields (``key: field name``), each with its type,
    default, checks and description. ``title`` names the section in errors."""
    definitions: dict[str, Any] = {k: (fields[f].annotation, fields[f]) for k, f in keys.items()}
    return create_model(title, __base__=base, __module__=__name__, **definitions)


def _pydantic_fields(config: type) -> dict[str, FieldInfo]:
    fields: dict[str, FieldInfo] = config.__pydantic_fields__  # type: ignore[attr-defined]
    return fields


if TYPE_CHECKING:  # the sections are built from the configs' fields below; typed as tables
    Limits: TypeAlias = _Section
    Auth: TypeAlias = _Section
    Learning: TypeAlias = _LearningSection
    Store: TypeAlias = _Section
else:
    _FRONT = _pydantic_fields(FrontConfig)
    Limits = _section("limits", _FRONT, {k: k for k in LIMITS})
    Auth = _section("auth", _FRONT, {k: k for k in AUTH})
    Learning = _section("learning", _pydantic_fields(LearnConfig),
                        {k: k for k in _pydantic_fields(LearnConfig)}, _LearningSection)
    Store = _section("store", _FRONT, STORE)


def _default(config: type, name: str) -> Any:
    """The library's default of a setting (a launch's or the front's), never written again."""
    return config.__dataclass_fields__[name].default  # type: ignore[attr-defined]


def _launch_default(name: str) -> Any:
    return _default(LaunchConfig, name)


FRONT_HOST: str = _default(FrontConfig, "host")


def _spelled(value: object) -> object:
    """A number written in the file (``guard = 0.5``, ``repair = 32``) as the command line
    spells it: one type, ``str``."""
    return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value


Spelled = Annotated[str, BeforeValidator(_spelled)]


class ServeConfig(BaseModel):
    """Every setting of ``kvnotes serve``; each field's description is its help."""

    model_config = ConfigDict(extra="forbid", frozen=True, title="ServeConfig")

    model: Annotated[str, Field(description="Model alias, .gguf file or HF folder")] = (
        _launch_default("model"))
    skills: Annotated[Path | None, Field(description=(
        "Skill-library folder (created if missing; required): skills registered there are "
        "spliced, also while the server runs"))] = None
    skill: Annotated[tuple[Path, ...], Field(description=(
        "Text files registered as skills at start (each one's name is its file's stem)"))] = ()
    header: Annotated[Path | None, Field(description=(
        "Text file of the system header requests start with: registered as a piece, and the "
        "skill files are compiled behind it (closer to a full prefill)"))] = None
    port: Annotated[int | None, Field(strict=True, ge=0, le=65535, description=(
        "Port clients use (the OpenAI front's, or vLLM's with --no-front; default: a free "
        "one)"))] = None
    host: Annotated[str, Field(description=(
        "Address the front listens on (0.0.0.0: every interface; give --api-key or --key-file "
        "then). vLLM itself stays on 127.0.0.1"))] = FRONT_HOST
    no_front: Annotated[bool, Field(description=(
        "Serve vLLM on the port directly, with no OpenAI front (clients send token ids, a "
        "splice request and its salt themselves, e.g. ComposeClient)"))] = False
    repair: Annotated[Spelled | None, Field(description=(
        "What each spliced skill recomputes in context: K its first K tokens (0: a bare "
        "splice), K@F at least the share F of it (e.g. 32@0.1), rounded up to the block "
        "(default: the front's, 32@0.1)"))] = None
    guard: Annotated[Spelled, Field(description=(
        "Answer from an exact request when the first token's top-2 log-prob margin is under "
        "this tau: auto (the model's calibrated default, off for a model without one), 0 "
        "(never) or a margin such as 0.5"))] = "auto"
    dtype: Annotated[str, Field(description=(
        "Server dtype: auto (bfloat16 where the CPU has native bf16, else float32), float32, "
        "bfloat16 or float16"))] = _launch_default("dtype")
    block_size: Annotated[int | None, Field(strict=True, ge=1, description=(
        "vLLM KV block size (CPU: a multiple of 32; default 128, learning.block_size when "
        "learning)"))] = None
    max_model_len: Annotated[int | None, Field(strict=True, ge=1, description=(
        "Longest prompt plus answer, in tokens (YAML null: the model's own limit)"))] = (
        _launch_default("max_model_len"))
    kv_cache_gib: Annotated[int, BeforeValidator(check_kv_cache_gib), Field(description=(
        "CPU KV cache size in whole GiB (vLLM's CPU build takes no fractions)"))] = (
        _launch_default("kv_cache_gib"))
    vllm_python: Annotated[str | None, Field(description=(
        "Python of the vLLM environment (default: $KVNOTES_VLLM_PYTHON or "
        ".venv-vllm/bin/python)"))] = None
    log: Annotated[Path | None, Field(description=(
        "Server log file (default: in $TMPDIR)"))] = None
    startup_timeout: Annotated[float, Field(gt=0, description=(
        "Seconds to wait for vLLM to become healthy"))] = _launch_default("startup_timeout")
    request_log: Annotated[bool, Field(description=(
        "One JSON line per request on stderr (the front's INFO log: id, tenant, plan, "
        "outcome)"))] = True
    vllm_args: Annotated[tuple[str, ...], Field(description=(
        "vLLM flags, passed unchanged (the command line's after --, which replace these); "
        "what the connector cannot run with is refused"))] = ()
    limits: Annotated[Limits, Field(default_factory=Limits, description=(
        "The front's bounds and timeouts"))]
    auth: Annotated[Auth, Field(default_factory=Auth, description="The front's keys")]
    learning: Annotated[Learning, Field(default_factory=Learning, description=(
        "Learning the chunks requests carry"))]
    store: Annotated[Store, Field(default_factory=Store, description=(
        "A Redis store the fleet of hosts shares (default: this host's folder alone)"))]

    @model_validator(mode="after")
    def _refuse_early(self) -> ServeConfig:
        """The refusals that need no model: a bad setting fails before any weights load."""
        from kvnotes.serving.front.guard_defaults import parse_guard
        from kvnotes.serving.vllm.checks import check_vllm_args

        self._check_skills()
        if self.no_front:
            self._check_without_front()
        learning = self.learning.model_dump()
        if not learning["enabled"] and (learning["library_cap"] is not None
                                        or learning["tenant_quota"] is not None):
            raise InvalidArgumentError("learning.library_cap and learning.tenant_quota bound "
                                       "learned entries: add --learn (learning.enabled)")
        self._check_store()
        if self.dtype not in DTYPES:
            raise InvalidArgumentError(f"--dtype {self.dtype!r}: use one of {', '.join(DTYPES)}")
        check_vllm_args(list(self.vllm_args))
        parse_guard(self.guard)
        if self.repair is not None:
            front_repair(self.repair)
        return self

    def _check_skills(self) -> None:
        if self.skills is None:
            raise InvalidArgumentError("give --skills DIR (this host's skill library; or "
                                       "skills = \"DIR\" in the --config file)")
        if self.skills.exists() and not self.skills.is_dir():
            raise UnsafePathError(f"--skills: {self.skills} is a file; give a folder path (it "
                                  "is created when missing)")

    def _check_without_front(self) -> None:
        auth = self.auth.model_dump()
        if auth["api_key"] or auth["key_file"] or auth["metrics_key"] \
                or self.host != FRONT_HOST:
            raise InvalidArgumentError("--host, --api-key, --key-file and auth.metrics_key are "
                                       "the front's: drop --no-front, or pass vLLM's own flags "
                                       "after --")
        if self.learning.enabled:
            raise InvalidArgumentError("--learn is the front's (it sees the requests' chunks): "
                                       "drop --no-front")

    def _check_store(self) -> None:
        """The store's URL and password file, read before any weights load."""
        from kvnotes.serving.store.url import check_store, parse_store_url

        store = self.store.model_dump()
        if store["url"] is None:
            if store["password_file"] is not None:
                raise InvalidArgumentError("store.password_file is the store's: add --store "
                                           "redis://HOST:PORT/DB (store.url)")
            return
        if self.no_front:
            raise InvalidArgumentError("--store is the front's (it mirrors and learns): drop "
                                       "--no-front")
        if not parse_store_url(store["url"]).is_redis:
            raise InvalidArgumentError("--store takes a redis:// or rediss:// URL (this host's "
                                       "own folder is --skills)")
        check_store(store["url"], store["password_file"])

    def learn_config(self) -> LearnConfig | None:
        """The front's learning (None when ``learning.enabled`` is off)."""
        learning = self.learning.model_dump()
        if not learning.pop("enabled"):
            return None
        return LearnConfig(**learning)

    def front_config(self) -> FrontConfig | None:
        """The front's settings (None with ``no_front``); a bad key file fails here."""
        from kvnotes.serving.front.guard_defaults import parse_guard

        if self.no_front:
            return None
        store = {STORE[key]: value for key, value in self.store.model_dump().items()}
        front = FrontConfig(port=self.port, host=self.host, guard=parse_guard(self.guard),
                            learn=self.learn_config(), **self.limits.model_dump(),
                            **self.auth.model_dump(), **store)
        if self.repair is not None:  # else the front's own default repair
            front = replace(front, repair=front_repair(self.repair))
        front.keys  # noqa: B018 -- a bad key file fails before the model loads
        return front

    def launch_config(self, front: FrontConfig | None) -> LaunchConfig:
        """The launch: vLLM with the connector over ``skills``, and ``front`` before it."""
        return LaunchConfig(
            model=self.model, dtype=self.dtype, block_size=self.block_size,
            kv_cache_gib=self.kv_cache_gib, max_model_len=self.max_model_len,
            port=self.port if self.no_front else None, skills=self.skills, log_path=self.log,
            startup_timeout=self.startup_timeout, vllm_python=self.vllm_python, front=front,
            extra_args=self.vllm_args)


# ---- reading the file and the command line -----------------------------------------------------
# Settings as read, before ServeConfig validates them: tables of values of any type (a file's
# strings and numbers, the command line's paths), nested by section.
RawSettings: TypeAlias = dict[str, object]


def read_config_file(path: Path) -> RawSettings:
    """The settings a TOML (``.toml``) or YAML (``.yaml``, ``.yml``) file holds, as tables."""
    if not path.is_file():
        raise InvalidArgumentError(f"--config: no file at {path}")
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml"):
        raise InvalidArgumentError(f"--config {path}: give a .toml, .yaml or .yml file")
    try:
        text = path.read_text("utf-8")
        data = tomllib.loads(text) if suffix == ".toml" else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, yaml.YAMLError) as err:
        kind = "TOML" if suffix == ".toml" else "YAML"
        raise InvalidArgumentError(f"--config {path}: not readable {kind}: {err}") from err
    if data is None:  # an empty YAML file
        return {}
    if not isinstance(data, dict):
        raise InvalidArgumentError(f"--config {path}: the file must hold a table of settings")
    return data


def load_serve_config(path: Path | None = None, *, given: Mapping[str, object] | None = None,
                      env: Mapping[str, str] | None = None) -> ServeConfig:
    """The settings of ``path`` (None: none), overridden by :data:`ENV`'s variables set in
    ``env`` (default ``os.environ``), overridden by ``given`` (dotted keys: what the command
    line gave).

    Raises:
        InvalidArgumentError: an unknown key (named, with the file), a bad value (the setting
            named, with where it came from), or a refusal of :class:`ServeConfig`.
    """
    data = read_config_file(path) if path is not None else {}
    origin: dict[str, str] = {}
    env = os.environ if env is None else env
    for key, name in ENV.items():
        if env.get(name):
            _set(data, key, env[name], path)
            origin[key] = f"${name}"
    for key, value in (given or {}).items():
        _set(data, key, value, path)
        origin[key] = FLAGS.get(key, key)
    try:
        return ServeConfig.model_validate(data)
    except ValidationError as err:
        raise _config_error(err, path, origin) from None


def _set(data: RawSettings, key: str, value: object, path: Path | None) -> None:
    """``data[a][b] = value`` for ``key`` ``a.b``."""
    *sections, name = key.split(".")
    for section in sections:
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            raise InvalidArgumentError(f"--config {path}: {section} must be a table of settings "
                                       f"(it holds {table!r})")
        data = table
    data[name] = value


def _config_error(err: ValidationError, path: Path | None, origin: Mapping[str, str]
                  ) -> KvnotesError:
    """``err`` as one :class:`InvalidArgumentError`: each setting named by its key, with where
    its value came from (the option, the variable or the file)."""
    errors = err.errors()
    parts: list[str] = []
    for e in errors:
        key = ".".join(str(p) for p in e["loc"])
        cause = (e.get("ctx") or {}).get("error")
        if e["type"] == "extra_forbidden":
            parts.append(f"unknown setting {key!r} in {path} ({_known(key)})")
            continue
        where = origin.get(key) or (str(path) if path is not None else "")
        if isinstance(cause, KvnotesError):
            if not key and len(errors) == 1:
                return cause  # a refusal that names its settings itself
            if str(cause).startswith(key):  # the check named the setting already
                parts.append(f"{cause} ({where})" if where else str(cause))
                continue
            text = str(cause)
        else:
            text = f"{e['msg']} (got {e['input']!r})"
        parts.append(f"{key} ({where}): {text}" if key and where else f"{key or where}: {text}")
    return InvalidArgumentError("; ".join(parts))


def _known(key: str) -> str:
    """What the table holding ``key`` takes, for the error of an unknown key."""
    *sections, _ = key.split(".")
    model: type[BaseModel] = ServeConfig
    for section in sections:
        annotation = model.model_fields[section].annotation if section in model.model_fields \
            else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return "see examples/serve.toml"
        model = annotation
    where = f"[{'.'.join(sections)}]" if sections else "the top level"
    return f"{where} takes {', '.join(model.model_fields)}"


def field_info(key: str) -> FieldInfo:
    """The field a dotted key names (``auth.api_key``): its type, default and description."""
    *sections, name = key.split(".")
    model: type[BaseModel] = ServeConfig
    for section in sections:
        model = model.model_fields[section].annotation  # type: ignore[assignment]
    return model.model_fields[name]
