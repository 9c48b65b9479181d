"""The embedding API as an app developer uses it: typed request fields, errors that name the
field and come before the first event, streams that cancel when left, one Done per choice,
lifecycle errors that say what to do, restart after the engine gave up, reopening."""

from __future__ import annotations

import anyio
import pytest
from conftest import wait_until

import llamactor.runtime as public
from llamactor.runtime import (
    Done,
    GenerationRequest,
    Progress,
    RequestError,
    Runtime,
    Token,
    Unavailable,
)

PROMPT = "The quick brown fox"


async def test_chat_takes_every_request_field_return_progress_included(make_config):
    """``rt.chat(..., return_progress=True)`` runs (it failed when the chat path lost fields)."""
    async with Runtime.open(make_config()) as rt:
        result = await rt.chat([{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, return_progress=True)
        assert result.completion.n_predicted == 4
        events = [ev async for ev in rt.stream(PROMPT, max_tokens=2, return_progress=True)]
        assert isinstance(events[0], Progress)


async def test_wrong_types_and_values_raise_request_errors_naming_the_field(make_config):
    async with Runtime.open(make_config()) as rt:
        cases = {
            "temperature": {"temperature": "hot"},
            "max_tokens": {"max_tokens": -5},
            "top_p": {"top_p": 2.0},
            "stop": {"stop": [1, 2]},
            "tags": {"tags": {"a": 1}},
            "n": {"n": 99},
            "id_slot": {"id_slot": 77},
            "seed": {"seed": 1.5},
            "max_tokenz": {"max_tokenz": 5},
        }
        for field, kwargs in cases.items():
            with pytest.raises(RequestError, match=field):
                await rt.complete(PROMPT, **kwargs)
        assert rt.in_flight() == 0
        out = await rt.complete(PROMPT, max_tokens=3, temperature=0)  # nothing else was lost
        assert out.n_predicted == 3


async def test_a_string_stop_is_one_stop_string(make_config):
    async with Runtime.open(make_config()) as rt:
        handle = await rt.submit(PROMPT, max_tokens=1, stop="abc")
        assert handle.task.stop == ("abc",)
        await handle.result()


async def test_request_errors_come_before_the_first_event(make_config):
    """``await rt.stream(...)`` raises a too-long prompt's error itself (a route can answer 400)."""
    async with Runtime.open(make_config()) as rt:
        with pytest.raises(RequestError, match="slot context"):
            await rt.stream("word " * 5000, max_tokens=4)
        events = await rt.stream(PROMPT, max_tokens=3, temperature=0)
        async with events:
            got = [ev async for ev in events]
        assert [type(ev) for ev in got] == [Token, Token, Token, Done]


async def test_leaving_an_async_for_cancels_the_request_at_once(make_config):
    """``break`` out of ``async for`` over a stream: the request stops within one decode step."""
    async with Runtime.open(make_config()) as rt:
        metrics = rt.engine.metrics.groups[0]
        async for ev in rt.stream(PROMPT, max_tokens=500, ignore_eos=True, temperature=0):
            if isinstance(ev, Token) and ev.index == 0:
                steps = metrics.n_decode
                break
        await wait_until(lambda: rt.in_flight() == 0)
        assert metrics.n_decode - steps <= 1
        handle = await rt.submit(PROMPT, max_tokens=500, ignore_eos=True)

        async def leave_with_an_error() -> None:
            async for _ in handle:
                raise ValueError("the app failed")

        with pytest.raises(ValueError):
            await leave_with_an_error()
        await wait_until(lambda: rt.in_flight() == 0)
        assert handle.closed


async def test_max_tokens_zero_sends_one_done_per_choice(make_config):
    async with Runtime.open(make_config()) as rt:
        events = [ev async for ev in rt.stream(PROMPT, max_tokens=0, n=2)]
        assert sorted(ev.index for ev in events if isinstance(ev, Done)) == [0, 1]
        assert all(isinstance(ev, Done) and ev.finish_reason == "length" for ev in events)


def test_stream_event_types_and_the_request_are_exported():
    for name in ("Token", "Done", "Progress", "GenerationRequest", "RequestHandle", "EventStream"):
        assert name in public.__all__ and getattr(public, name) is not None


async def test_using_it_before_it_is_opened_says_how_to_open_it(make_config):
    rt = Runtime(make_config())
    with pytest.raises(Unavailable, match="async with"):
        await rt.complete(PROMPT)


async def test_a_runtime_can_be_opened_again(make_config):
    rt = Runtime(make_config())
    async with rt:
        first = await rt.complete(PROMPT, max_tokens=3, temperature=0)
    with pytest.raises(Exception, match="not open"):
        await rt.complete(PROMPT)
    async with rt:
        again = await rt.complete(PROMPT, max_tokens=3, temperature=0)
    assert again.text == first.text
    with pytest.raises(RuntimeError, match="close it"):
        async with rt, rt:
            pass


async def test_a_prebuilt_request_runs_as_the_keywords_do(make_config):
    async with Runtime.open(make_config()) as rt:
        by_fields = await rt.complete(PROMPT, max_tokens=4, temperature=0)
        handle = await rt.submit_request(GenerationRequest(prompt=PROMPT, max_tokens=4, temperature=0))
        assert (await handle.result()).text == by_fields.text


async def test_restart_after_the_groups_gave_up(make_config):
    """In process: a group that fails past its restart limit is down ("unhealthy"); after
    ``rt.restart()`` it serves again."""
    from faults import Faults

    faults = Faults()
    async with Runtime.open(make_config(max_restarts=0), hooks=faults) as rt:
        faults.fail_decode = 1
        with pytest.raises(Exception):  # noqa: B017 - the injected failure
            await rt.complete(PROMPT, max_tokens=3)
        await wait_until(lambda: rt.health() == "unhealthy")
        with pytest.raises(Unavailable):
            await rt.complete(PROMPT, max_tokens=3)
        await rt.restart()
        assert rt.health() == "ok"
        assert (await rt.complete(PROMPT, max_tokens=3)).n_predicted == 3


@pytest.mark.slow
async def test_restart_after_the_engine_process_gave_up(make_config):
    """Isolated: an engine that died past ``engine_max_restarts`` is DOWN (requests 503);
    ``rt.restart()`` starts it again."""
    async with Runtime.open(make_config(engine_max_restarts=0), isolate=True) as rt:
        assert rt.health() == "ok"
        rt.engine.process.kill()
        await wait_until(lambda: rt.health() == "unhealthy", timeout_s=30)
        with pytest.raises(Unavailable, match="down"):
            await rt.complete(PROMPT, max_tokens=2)
        with anyio.fail_after(60):
            await rt.restart()
        assert rt.health() == "ok"
        assert (await rt.complete(PROMPT, max_tokens=2)).n_predicted == 2
