"""Built-in scheduling policies, selectable by name with ``--scheduler``."""

from __future__ import annotations

import importlib

from actors.policies.cohort import CohortPolicy, SerialPrefillPolicy
from actors.policies.continuous import ContinuousPolicy, NoContBatchingPolicy
from actors.policies.stallfree import StallFreePolicy
from actors.policy import Policy
from runtime.errors import ConfigError

BUILTIN: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (ContinuousPolicy, NoContBatchingPolicy, SerialPrefillPolicy, CohortPolicy, StallFreePolicy)
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
