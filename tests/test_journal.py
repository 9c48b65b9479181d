"""The journal's resume rules, driven without processes or a model: what reaches the client,
what a resumed request replays (exact and fast), n > 1 choices, stop strings, seeds, and the
resume limit. Plus the two things that cross the engine link as data: errors and the config."""

from __future__ import annotations

import anyio
import msgspec
import numpy as np
import pytest

from llamactor.protocol import errors
from llamactor.protocol.enginelink import Events, Submit
from llamactor.protocol.events import Done, Failed, Progress, Token
from llamactor.protocol.messages import Speculation, Task
from llamactor.protocol.sampling import DEFAULT_SEED, SamplingParams
from llamactor.runtime.service.config import RuntimeConfig, config_from_wire, config_to_wire
from llamactor.runtime.service.journal import SEED_STEP, Journal, wire

PROMPT = np.array([5, 6, 7], dtype=np.int32)


def task(task_id: int = 1, n: int = 1, seed: int = DEFAULT_SEED, temperature: float = 0.0, **fields: object) -> Task:
    send, recv = anyio.create_memory_object_stream[object](100)
    recv.close()
    send.close()
    return Task(
        id=task_id,
        params=SamplingParams(seed=seed, temperature=temperature),
        n_predict=10,
        n=n,
        **fields,  # type: ignore[arg-type]
        stop=("STOP",),
        prompt=PROMPT,
        sink=send,
    )


def tok(task_id: int, token: int, index: int = 0, text: str = "x") -> tuple[int, Token]:
    return task_id, Token(index=index, text=text, token=token)


def done(task_id: int, index: int = 0, n_prompt: int = 3) -> tuple[int, Done]:
    return task_id, Done(
        index=index,
        finish_reason="stop",
        text="",
        stopping_word="",
        n_prompt=n_prompt,
        n_cached=0,
        n_predicted=1,
        prompt_ms=0,
        predicted_ms=0,
        slot=0,
    )


def test_delivered_tokens_are_journaled_and_passed_on():
    j = Journal(resume_max=3)
    entry = j.add(task())
    out, resumed = j.deliver(Events((tok(1, 11), tok(1, 12), (99, Token(0, "", 1)))), now=1.0)
    assert [ev.token for _, ev in out] == [11, 12] and not resumed  # task 99 is not (any more) ours
    assert entry.delivered == [[11, 12]]


def test_a_death_then_an_exact_resume_replays_what_was_delivered():
    j = Journal(resume_max=3)
    entry = j.add(task())
    entry.sent = True
    j.deliver(Events((tok(1, 11), tok(1, 12))), now=1.0)
    j.lost(None, now=2.0)
    assert not entry.sent and entry.deaths == 1 and entry.lost_at == 2.0
    [(e, w)] = list(j.unsent())
    assert e is entry and w.replay == ((11, 12),) and not w.replay_in_prompt
    assert np.frombuffer(w.prompt, dtype=np.int32).tolist() == [5, 6, 7]
    assert w.stop == ("STOP",)  # the resolved stop strings travel with it
    assert j.submitted(entry, w) and entry.resumes == 1
    out, resumed = j.deliver(Events((tok(1, 13),)), now=2.5)
    assert [r.pause_s for r in resumed] == [0.5] and resumed[0].replayed == 2
    assert entry.delivered == [[11, 12, 13]]


def test_a_fast_resume_appends_the_delivered_tokens_to_the_prompt():
    j = Journal(resume_max=3, fast=True)
    entry = j.add(task())
    entry.sent = True
    j.deliver(Events((tok(1, 11),)), now=1.0)
    j.lost(None, now=2.0)
    [(_, w)] = list(j.unsent())
    assert w.replay_in_prompt and w.replay == ((11,),)  # the group primes its sampler with them
    assert np.frombuffer(w.prompt, dtype=np.int32).tolist() == [5, 6, 7, 11]
    j.submitted(entry, w)
    out, _ = j.deliver(Events((done(1, n_prompt=4),)), now=3.0)
    assert out[0][1].n_prompt == 3  # the client sees its own prompt length


def test_a_request_that_had_not_started_is_sent_again_as_it_was():
    j = Journal(resume_max=3)
    entry = j.add(task(return_progress=True))
    entry.sent = True
    j.lost(None, now=1.0)
    [(_, w)] = list(j.unsent())
    assert w.replay == () and w.return_progress
    assert not j.submitted(entry, w) and entry.resumes == 0


def test_n_choices_a_finished_choice_sends_nothing_more():
    j = Journal(resume_max=3, fast=True)  # fast resume needs one choice: n = 2 replays exactly
    entry = j.add(task(n=2))
    entry.sent = True
    j.deliver(Events((tok(1, 11, 0), tok(1, 21, 1), done(1, 1))), now=1.0)
    j.lost(None, now=2.0)
    [(_, w)] = list(j.unsent())
    assert w.replay == ((11,), (21,)) and not w.replay_in_prompt
    j.submitted(entry, w)
    out, _ = j.deliver(Events((tok(1, 12, 0), tok(1, 22, 1), done(1, 1), done(1, 0))), now=3.0)
    assert [(type(ev).__name__, ev.index) for _, ev in out] == [("Token", 0), ("Done", 0)]


def test_progress_events_of_a_resumed_request_are_dropped():
    j = Journal(resume_max=3)
    entry = j.add(task(return_progress=True))
    entry.sent = True
    j.deliver(Events((tok(1, 11),)), now=1.0)
    j.lost(None, now=2.0)
    [(_, w)] = list(j.unsent())
    assert not w.return_progress
    j.submitted(entry, w)
    out, _ = j.deliver(Events(((1, Progress(0, 3, 0, 3, 1.0)), tok(1, 12))), now=3.0)
    assert [type(ev) for _, ev in out] == [Token]


def test_a_seeded_sampling_request_resumes_with_a_seed_of_its_own():
    entry_task = task(seed=42, temperature=0.8)
    w = wire(entry_task, [[11, 12]], resumes=1)
    assert w.params.seed == (42 * SEED_STEP + 2) % 2**32
    assert wire(task(seed=42, temperature=0.0), [[11]], resumes=1).params.seed == 42  # greedy: no seed to move
    assert wire(task(seed=DEFAULT_SEED, temperature=0.8), [[11]], resumes=1).params.seed == DEFAULT_SEED


def test_deaths_count_for_the_suspects_and_past_the_limit_the_request_fails_alone():
    j = Journal(resume_max=1)
    poison, other = j.add(task(1)), j.add(task(2))
    for _ in range(2):
        poison.sent = other.sent = True
        j.lost({1}, now=1.0)  # the blackbox says it died inside task 1
        for entry, what in j.unsent():
            if not isinstance(what, Failed):
                j.submitted(entry, what)
    assert poison.deaths == 2 and other.deaths == 0
    poison.sent = other.sent = False
    plans = {e.task.id: what for e, what in j.unsent()}
    assert isinstance(plans[1], Failed) and "died 2 times" in plans[1].message
    assert not isinstance(plans[2], Failed)


def test_a_death_it_cannot_attribute_counts_for_every_request_it_held():
    j = Journal(resume_max=3)
    a, b = j.add(task(1)), j.add(task(2))
    a.sent = True
    j.lost(None, now=1.0)
    assert a.deaths == 1 and b.deaths == 0  # b was not in that engine


def test_the_resolved_speculation_crosses_the_link_and_a_resume():
    """The draft settings admission resolved reach the engine as they are, resumed or not."""
    spec = Speculation(4, 2, 0.5)
    for resumes in (0, 1):
        frame = msgspec.msgpack.encode(Submit(wire(task(speculation=spec), [[9]], resumes)))
        assert msgspec.msgpack.decode(frame, type=Submit).task.task(None).speculation == spec


@pytest.mark.parametrize("cls", list(errors.ERRORS.values()))
def test_every_error_crosses_as_its_class_and_message(cls):
    exc = cls("what went wrong")
    event = Failed.of(exc)
    again = errors.error_from(event.error, event.message)
    assert type(again) is cls and str(again) == "what went wrong" and again.status == exc.status
    assert type(errors.error_from("NoSuchError", "m")) is errors.EngineError


def test_the_config_crosses_as_msgspec(tmp_path):
    from examples.custom_policy import ShortestPromptFirst

    cfg = RuntimeConfig(
        model=tmp_path / "m.gguf",
        stop=("a",),
        lora=(("x.gguf", 0.5),),
        scheduler=ShortestPromptFirst,
        scheduler_options={"k": 1},
        sampling=SamplingParams(temperature=0.1, logit_bias=((3, 1.0),)),
    )
    back = config_from_wire(config_to_wire(cfg))
    assert back.scheduler == "examples.custom_policy:ShortestPromptFirst"
    assert msgspec.structs.replace(back.sampling) == cfg.sampling and back.stop == ("a",) and back.lora == cfg.lora
    assert str(back.model) == str(cfg.model) and back.scheduler_options == {"k": 1}
    instance = config_from_wire(config_to_wire(RuntimeConfig(scheduler=ShortestPromptFirst(0, k=2)))).scheduler
    assert isinstance(instance, ShortestPromptFirst) and instance.options == {"k": 2}


def test_a_policy_defined_in_a_function_cannot_cross_and_says_why():
    from llamactor.actors.policies.continuous import ContinuousPolicy

    class Local(ContinuousPolicy):
        pass

    with pytest.raises(errors.ConfigError, match="module level"):
        config_to_wire(RuntimeConfig(scheduler=Local))
