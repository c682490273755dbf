"""Where the vLLM and SGLang adapters find their draft service: the environment, or a mapping.

Why the environment: those engines build a drafter from a class path alone (vLLM passes its
whole `VllmConfig`, SGLang its server arguments), in every worker process, and neither has a
documented field for a drafter's own options. Worker processes inherit the launcher's
environment, so `REDRAFT_SERVICE=10.0.0.5:50051 vllm serve ...` reaches every worker. A
mapping (e.g. vLLM's `additional_config={"redraft": {...}}`) overrides the environment key by
key, with the same names lower-cased and without the prefix.

    REDRAFT_SERVICE      HOST:PORT of `redraft serve` (several comma-separated, or
                         dns:///NAME:PORT, for replicas)
    REDRAFT_DATASTORE    or a datastore directory, drafted in the engine's process
    REDRAFT_TOKEN        bearer token (or REDRAFT_TOKEN_FILE: a file holding it)
    REDRAFT_TENANT       whose learned outputs to draft from and add to
    REDRAFT_CORPORA      comma-separated corpus names (default: all)
    REDRAFT_BUDGET       tree nodes per sequence and step (default 64)
    REDRAFT_MAX_DEPTH    deepest draft (default 16)
    REDRAFT_LEARN        1/0: learn from and draft served outputs (default 1)
    REDRAFT_TIMEOUT      seconds one batched call may take (default 0.5)
    REDRAFT_RETRY_AFTER  seconds of prompt lookup after the service failed (default 30)
    REDRAFT_TOKENIZER    a model name or .gguf path whose tokenizer must be the datastore's
    REDRAFT_ADAPTIVE     1/0: hand each row only the drafts that pay at the engine's measured
                         step cost (default 1); 0: every row's whole chain
    REDRAFT_ADAPTER_METRICS_PORT  serve the adapter's Prometheus counters at /metrics on this
                         port of the engine's process (`adapter_prometheus`; default: not)
    REDRAFT_ADAPTER_METRICS_HOST  the address it listens on (default 127.0.0.1)

Tested by: tests/decoder/engines/test_sglang.py, tests/decoder/engines/test_vllm.py
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from redraft.decoder.engines.streams import DraftOptions, DraftSource, EngineConfigError
from redraft.proto.params import DraftParams

PREFIX = "REDRAFT_"
NAMES = ("service", "datastore", "token", "token_file", "tenant", "corpora", "budget",
         "max_depth", "learn", "timeout", "retry_after", "tokenizer", "adaptive",
         "adapter_metrics_port", "adapter_metrics_host")


@dataclass
class EngineSettings:
    """An engine adapter's options, as read (see the module docstring)."""

    service: str | None = None
    datastore: str | None = None
    token: str | None = None
    tokenizer: str | None = None
    options: DraftOptions = field(default_factory=DraftOptions)
    timeout: float = 0.5
    retry_after: float = 30.0
    adaptive: bool = True
    metrics_port: int | None = None  # the adapter's own /metrics (adapter_prometheus)
    metrics_host: str = "127.0.0.1"

    @classmethod
    def read(cls, config: Mapping | None = None,
             environ: Mapping[str, str] | None = None) -> EngineSettings:
        """The settings from `config` (lower-case names) over `environ` (REDRAFT_*)."""
        environ = os.environ if environ is None else environ
        if config is not None and not isinstance(config, Mapping):
            raise EngineConfigError(f"redraft's engine config must be a mapping, got "
                                    f"{type(config).__name__}")
        config = dict(config or {})
        unknown = sorted(set(config) - set(NAMES))
        if unknown:
            raise EngineConfigError(f"unknown redraft engine options {unknown} "
                                    f"(known: {', '.join(NAMES)})")
        raw = {name: config[name] if name in config else environ.get(PREFIX + name.upper())
               for name in NAMES}
        token = raw["token"]
        if token is None and raw["token_file"]:
            try:
                with open(raw["token_file"], encoding="utf-8") as f:
                    token = f.read().strip()
            except OSError as exc:
                raise EngineConfigError(f"cannot read the token file {raw['token_file']}: "
                                        f"{exc.strerror or exc}") from None
        corpora = raw["corpora"] or ()
        if isinstance(corpora, str):
            corpora = tuple(c.strip() for c in corpora.split(",") if c.strip())
        defaults = DraftOptions()
        params = DraftParams(
            budget=_number(raw["budget"], "budget", int, defaults.params.budget),
            max_depth=_number(raw["max_depth"], "max_depth", int, defaults.params.max_depth),
            corpora=tuple(corpora))
        options = DraftOptions(params, tenant=str(raw["tenant"] or ""),
                               learn=_flag(raw["learn"], "learn", defaults.learn))
        options.check()
        return cls(service=raw["service"] or None, datastore=raw["datastore"] or None,
                   token=token or None, tokenizer=raw["tokenizer"] or None, options=options,
                   timeout=_number(raw["timeout"], "timeout", float, 0.5),
                   retry_after=_number(raw["retry_after"], "retry_after", float, 30.0),
                   adaptive=_flag(raw["adaptive"], "adaptive", True),
                   metrics_port=_port(raw["adapter_metrics_port"], "adapter_metrics_port"),
                   metrics_host=str(raw["adapter_metrics_host"] or "127.0.0.1"))

    def source(self, budget: int | None = None, max_depth: int | None = None) -> DraftSource:
        """The draft source these settings name, its tree no larger than `budget` nodes and
        `max_depth` deep (what the engine can verify), whichever is smaller."""
        if self.service is None and self.datastore is None:
            raise EngineConfigError(f"redraft needs a draft service or a datastore: set "
                                    f"{PREFIX}SERVICE=HOST:PORT (a `redraft serve`) or "
                                    f"{PREFIX}DATASTORE=DIR")
        if self.service is not None and self.datastore is not None:
            raise EngineConfigError(f"set only one of {PREFIX}SERVICE and "
                                    f"{PREFIX}DATASTORE")
        p = self.options.params
        options = replace(self.options, params=p.replace(
            budget=min(p.budget, budget or p.budget),
            max_depth=min(p.max_depth, max_depth or p.max_depth)))
        return DraftSource(service=self.service, datastore=self.datastore, options=options,
                           token=self.token, tokenizer=self.tokenizer, timeout=self.timeout,
                           retry_after=self.retry_after)


def _number(value, name: str, kind: type, default):
    if value is None or value == "":
        return default
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise EngineConfigError(f"{name} must be a number, got {value!r}") from None
    if not number > 0:
        raise EngineConfigError(f"{name} must be positive, got {value!r}")
    return number


def _port(value, name: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        port = int(value)
    except (TypeError, ValueError):
        port = -1
    if isinstance(value, bool) or not 0 < port < 65536:
        raise EngineConfigError(f"{name} must be a port number 1..65535, got {value!r}")
    return port


def _flag(value, name: str, default: bool) -> bool:
    if value is None or value == "":
        return default
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise EngineConfigError(f"{name} must be 1 or 0, got {value!r}")
