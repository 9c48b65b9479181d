"""``GroupHooks``: the seam through which tests (or a chaos harness) observe and perturb a group.

A collaborator injected at ``Runtime(config, hooks=...)`` and handed to every group and its
context. Each method is one point of a request's life; raising from it is a failure at that
point. When no hooks are given, the group and context bind the plain functions instead: the
hot path has no extra call and no branch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from llamactor.protocol.messages import Task


class GroupHooks(Protocol):
    def on_assign(self, group: int, task: Task) -> None:
        """A task reached its group; its sampler chains are built next (per request)."""

    def before_decode(self, group: int, n_prompt: int, n_generate: int) -> None:
        """In the group's worker thread, before ``llama_decode`` (per step; not the warm-up's)."""

    # Optional (looked up with getattr): ``before_warmup(group)``, in the worker thread before
    # each of a new context's warm-up decodes (twice per context, before the engine is ready).

    def before_sample(self, group: int, task: Task) -> None:
        """In the worker thread, before one of the task's tokens is sampled (per token)."""

    def before_send(self, group: int, task: Task) -> None:
        """On the event loop, before a task's events of this step are sent (per step and task)."""

    def after_step(self, group: Any, result: Any) -> None:
        """On the event loop, after a step's events were delivered (per step)."""
