"""Built-in scheduling policies, selectable by name with ``--scheduler``; custom ones by
module or file path."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from llamactor.actors.policies.adaptive import AdaptivePolicy
from llamactor.actors.policies.cohort import CohortPolicy, SerialPrefillPolicy
from llamactor.actors.policies.continuous import ContinuousPolicy, NoContBatchingPolicy
from llamactor.actors.policies.priority import PriorityPolicy
from llamactor.actors.policies.slo import SloPolicy
from llamactor.actors.policies.stallfree import StallFreePolicy
from llamactor.actors.policy import Policy
from llamactor.protocol.errors import ConfigError

BUILTIN: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        ContinuousPolicy,
        NoContBatchingPolicy,
        SerialPrefillPolicy,
        CohortPolicy,
        StallFreePolicy,
        AdaptivePolicy,
        PriorityPolicy,
        SloPolicy,
    )
}


PolicySpec = str | type[Policy] | Policy


def resolve_policy(spec: PolicySpec) -> type[Policy]:
    """The policy class ``spec`` names (ConfigError if it cannot be loaded).

    ``spec`` is a built-in name (``"continuous"``), ``package.module:Class`` (the current
    directory is searched first, as uvicorn does for its app argument), ``path/to/file.py:Class``
    (a file anywhere, loaded as a module of its own), a policy class, or a policy instance.
    """
    if isinstance(spec, Policy):
        return type(spec)
    if isinstance(spec, type):
        if not (issubclass(spec, Policy) or callable(getattr(spec, "plan", None))):
            raise ConfigError(f"scheduler {spec.__name__} is not a policy class (needs a plan() method)")
        return spec
    if not isinstance(spec, str):
        raise ConfigError(f"scheduler must be a name, module:Class, a Policy class or instance; got {spec!r}")
    if spec in BUILTIN:
        return BUILTIN[spec]
    if ":" not in spec:
        raise ConfigError(
            f"unknown scheduler {spec!r}; built-in: {', '.join(sorted(BUILTIN))}, "
            f"or module:Class, or path/to/file.py:Class"
        )
    cls = load_object(spec, "scheduler")
    if not (isinstance(cls, type) and callable(getattr(cls, "plan", None))):
        raise ConfigError(f"scheduler {spec!r} is not a policy class (needs a plan() method)")
    return cls


def policy_factory(spec: PolicySpec, options: Mapping[str, Any]) -> Callable[[int], Policy]:
    """``make(group)``: a new policy for one group (each group has its own, and a restarted
    group a fresh one). A class or name is instantiated as ``Class(group, **options)``; an
    instance is copied (``copy.deepcopy``) for each group, its ``group`` set."""
    if isinstance(spec, Policy):
        template = spec

        def copy_of(group: int) -> Policy:
            policy = copy.deepcopy(template)
            policy.group = group
            return policy

        return copy_of
    cls = resolve_policy(spec)

    def make(group: int) -> Policy:
        try:
            return cls(group, **options)
        except TypeError as exc:
            raise ConfigError(
                f"scheduler {policy_name(spec)} cannot be made with options {dict(options)}: {exc}"
            ) from exc

    return make


def policy_name(spec: PolicySpec) -> str:
    """How ``spec`` is shown (logs, /props, the live view): the name given, or the class's."""
    if isinstance(spec, str):
        return spec
    cls = spec if isinstance(spec, type) else type(spec)
    return f"{cls.__module__}:{cls.__qualname__}"


def load_object(spec: str, what: str) -> Any:
    """The object ``package.module:name`` or ``path/to/file.py:name`` names (ConfigError naming
    ``what`` if it cannot be loaded): custom policies, and the engine process's hooks."""
    target, _, attr = spec.rpartition(":")
    if not target:
        raise ConfigError(f"{what} {spec!r} must be module:name or path/to/file.py:name")
    try:
        module = _load_file(target) if target.endswith(".py") else _load_module(target)
        return getattr(module, attr)
    except (ImportError, AttributeError, OSError, SyntaxError) as exc:
        raise ConfigError(f"cannot load {what} {spec!r}: {exc}") from exc


def _load_module(name: str) -> ModuleType:
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    return importlib.import_module(name)


def _load_file(path: str) -> ModuleType:
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ImportError(f"no such file: {file}")
    name = f"llamactor_policy_{file.stem}_{abs(hash(str(file))):x}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {file} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
