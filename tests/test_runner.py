"""`edgespec.llamacpp_lm.Runner.stream`: a generator's items made on the runner's thread, ahead of the caller, and
stopped, closed and waited for when the caller stops (no llama.cpp needed: the runner is plain Python)."""

import threading
import time

import pytest

from edgespec.llamacpp_lm import Runner


def _items(log: list, n: int = 5, fail_at: int | None = None, pause: float = 0.0):
    try:
        for i in range(n):
            if i == fail_at:
                raise ValueError(f"item {i} failed")
            time.sleep(pause)
            log.append(("made", i, threading.get_ident()))
            yield i
    finally:
        log.append(("closed", threading.get_ident()))


def test_the_items_are_made_on_the_runners_thread_and_reach_the_caller_in_order():
    runner, log = Runner("test-stream"), []
    assert list(runner.stream(_items(log))) == [0, 1, 2, 3, 4]
    made = {who for what, *rest in log for who in rest[-1:]}
    assert made == {runner._thread.ident} != {threading.get_ident()}
    assert log[-1] == ("closed", runner._thread.ident)


def test_the_runner_does_not_wait_for_the_caller_to_take_an_item():
    runner, log = Runner("test-ahead"), []
    stream = runner.stream(_items(log, n=3))
    assert next(stream) == 0
    deadline = time.monotonic() + 5
    while len(log) < 4 and time.monotonic() < deadline:  # made the rest while this thread took nothing
        time.sleep(0.01)
    assert [entry[0] for entry in log] == ["made", "made", "made", "closed"]
    assert list(stream) == [1, 2]


def test_closing_the_stream_stops_the_runner_before_its_next_item_and_waits_for_it():
    runner, log = Runner("test-close"), []
    stream = runner.stream(_items(log, n=1000, pause=0.01))
    assert next(stream) == 0
    stream.close()  # returns once the runner has stopped and closed the generator, on its own thread
    assert log[-1] == ("closed", runner._thread.ident)
    made = len(log) - 1
    time.sleep(0.05)
    assert len(log) - 1 == made < 1000  # nothing more is made after the close
    assert runner.call(threading.get_ident) == runner._thread.ident  # and the runner serves the next call


def test_an_error_in_the_caller_while_it_consumes_stops_the_runner_too():
    runner, log = Runner("test-interrupt"), []
    with pytest.raises(KeyboardInterrupt):
        for item in runner.stream(_items(log, n=1000, pause=0.01)):
            if item == 2:
                raise KeyboardInterrupt
    assert log[-1][0] == "closed" and len(log) < 1000


def test_an_error_in_the_generator_reaches_the_caller_and_the_runner_stays_usable():
    runner, log = Runner("test-error"), []
    got = []
    with pytest.raises(ValueError, match="item 2 failed"):
        for item in runner.stream(_items(log, fail_at=2)):
            got.append(item)
    assert got == [0, 1] and log[-1][0] == "closed"
    assert list(runner.stream(_items([], n=2))) == [0, 1]


def test_on_the_runners_own_thread_the_items_are_made_in_place():
    runner = Runner("test-nested")
    assert runner.call(lambda: list(runner.stream(_items([], n=3)))) == [0, 1, 2]
