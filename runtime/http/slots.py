"""``GET /slots`` and ``POST /slots/{id}``: the groups' slot reports in llama-server's shapes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llamactor.protocol.slots import SlotActionResult, SlotState
from llamactor.runtime.http.generation_settings import sampling_settings

_COUNT_NAMES = {"erase": "n_erased", "save": "n_saved", "restore": "n_restored", "import": "n_imported"}


def slots_json(states: list[SlotState]) -> list[dict[str, Any]]:
    """One object per slot, as llama-server's ``/slots`` lists them, plus llamactor's own
    fields (``group``, ``phase``, ``cohort``, ``age_s``, ``priority``)."""
    return [slot_json(s) for s in states]


def slot_json(s: SlotState) -> dict[str, Any]:
    if s.phase == "down":
        return {"id": s.id, "group": s.group, "is_processing": False, "phase": "down"}
    row: dict[str, Any] = {
        "id": s.id,
        "n_ctx": s.n_ctx,
        "speculative": s.speculative,
        "is_processing": s.busy,
        "group": s.group,
        "phase": s.phase,
        "cohort": s.cohort,
        "n_cached_tokens": s.n_cached,
    }
    if s.task >= 0:  # the request it serves, or (idle) the one it served last, as llama-server's
        row.update(
            id_task=s.task,
            n_prompt_tokens=s.n_prompt,
            n_prompt_tokens_processed=s.n_prompt - s.n_prompt_cached,
            n_prompt_tokens_cache=s.n_prompt_cached,
            params=None if s.params is None else slot_params(s),
            next_token=[
                {
                    "has_next_token": s.busy,
                    "has_new_line": False,  # not tracked: llama-server's is about its stop words
                    "n_remain": s.n_remain,
                    "n_decoded": s.n_decoded,
                }
            ],
            age_s=s.age_s,
            priority=s.priority,
        )
    if s.draft_n is not None:  # the current (or last) request's drafts, llama-server's timings names
        row.update(draft_n=s.draft_n, draft_n_accepted=s.draft_n_accepted, draft_n_steps=s.draft_n_steps)
    return row


def slot_params(s: SlotState) -> dict[str, Any]:
    """llama-server's ``params`` of a slot's request (``task_params::to_json(only_metrics)``),
    the fields llamactor has. ``stream`` is null: the engine does not know how the client reads."""
    assert s.params is not None
    return sampling_settings(s.params, n_predict=s.n_predict, ignore_eos=s.ignore_eos, stream=None, lora=s.lora)


def slot_action_json(result: SlotActionResult, path: str = "") -> dict[str, Any]:
    """llama-server's answer to an erase, save or restore (and, shaped as a restore, to an import)."""
    out: dict[str, Any] = {"id_slot": result.slot, _COUNT_NAMES[result.action]: result.n_tokens}
    if result.action != "erase":
        out["timings"] = {f"{result.action}_ms": result.ms}
    if path:
        out["filename"] = Path(path).name
    return out
