"""Built-in scheduling policies, selectable by name with ``--scheduler``."""

from __future__ import annotations

import importlib

from actors.policies.continuous import ContinuousPolicy
from actors.policy import Policy
from runtime.errors import ConfigError

BUILTIN: dict[str, type[Policy]] = {
    ContinuousPolicy.name: ContinuousPolicy,
}


def resolve_policy(spec: str) -> type[Policy]:
    """``"continuous"`` or ``"package.module:Class"`` → the policy class (ConfigError if unknown)."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    if ":" not in spec:
        raise ConfigError(f"unknown scheduler {spec!r}; built-in: {', '.join(sorted(BUILTIN))}, or module:Class")
    module_name, _, attr = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load scheduler {spec!r}: {exc}") from exc
    if not (isinstance(cls, type) and callable(getattr(cls, "plan", None))):
        raise ConfigError(f"scheduler {spec!r} is not a policy class (needs a plan() method)")
    return cls
