"""sequences.hold_layers, the client's per-layer ordering of its own calls, without a server: an attend waits for
the layer's append in flight, an append for the attends in flight and for another append, a waiting append goes
before attends that come after it, and every waiter is woken when what it waits for ends (holders notify only
when a thread sleeps: a missed wake-up would hang here, bounded by the joins' timeouts)."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("flashserve.sequence_client", reason="no sequences.proto in this checkout")

from flashserve.sequences import Sequence, SequenceSpec, hold_layers  # noqa: E402

WAIT_S = 10  # a woken thread gets going within this on the most loaded machine
HOLD_S = 4 * WAIT_S  # a holder lets go by itself after this (so a failing test ends), long after any assert gave up


def _sequence():
    return Sequence(None, SequenceSpec(2, 4, 2, 64, "float16"), key=None, keep_history=False, prefix_source=None,
                    max_tokens=0, label="")


class _Holder(threading.Thread):
    """Takes the holds, records when it got them, keeps them until `release` is set."""

    def __init__(self, log, name, **holds):
        super().__init__(daemon=True)
        self.log, self.name, self.holds = log, name, holds
        self.release = threading.Event()
        self.holding = threading.Event()

    def run(self):
        with hold_layers(**self.holds):
            self.log.append(self.name)
            self.holding.set()
            self.release.wait(HOLD_S)


def _sleeping(seq, count):
    """Waits until `count` threads sleep on the sequence's condition."""
    deadline = time.monotonic() + WAIT_S
    while seq._sleepers < count:
        assert time.monotonic() < deadline, f"{seq._sleepers} of {count} threads came to wait"
        time.sleep(0.001)


def _finish(*holders):
    for h in holders:
        h.release.set()
    for h in holders:
        h.join(HOLD_S)
        assert not h.is_alive(), f"{h.name} was never woken"


def test_an_attend_waits_for_the_append_in_flight_and_is_woken_by_its_end():
    seq, log = _sequence(), []
    append = _Holder(log, "append", writes=[(seq, 0)])
    append.start()
    assert append.holding.wait(WAIT_S)
    attend = _Holder(log, "attend", reads=[(seq, 0)])
    attend.start()
    _sleeping(seq, 1)
    other_layer = _Holder(log, "other layer", reads=[(seq, 1)])  # not held back: another layer
    other_layer.start()
    assert other_layer.holding.wait(WAIT_S)
    assert log == ["append", "other layer"]
    _finish(append)
    assert attend.holding.wait(WAIT_S)
    _finish(attend, other_layer)
    assert log == ["append", "other layer", "attend"]
    assert seq._sleepers == 0 and not seq._writing and not +seq._reading and not +seq._waiting_writers


def test_a_waiting_append_goes_before_attends_that_come_after_it():
    seq, log = _sequence(), []
    first = _Holder(log, "attend 1", reads=[(seq, 0)])
    first.start()
    assert first.holding.wait(WAIT_S)
    append = _Holder(log, "append", writes=[(seq, 0)])
    append.start()
    _sleeping(seq, 1)
    second = _Holder(log, "attend 2", reads=[(seq, 0)])  # behind the waiting append, not beside attend 1
    second.start()
    _sleeping(seq, 2)
    _finish(first)
    assert append.holding.wait(WAIT_S)
    time.sleep(0.05)
    assert log == ["attend 1", "append"]  # attend 2 still waits: the append holds the layer
    _finish(append)
    assert second.holding.wait(WAIT_S)
    _finish(second)
    assert log == ["attend 1", "append", "attend 2"]


def test_appends_to_one_layer_take_turns_and_each_is_woken():
    seq, log = _sequence(), []
    holders = [_Holder(log, f"append {i}", writes=[(seq, 0)]) for i in range(6)]
    holders[0].start()
    assert holders[0].holding.wait(WAIT_S)
    for h in holders[1:]:
        h.start()
    _sleeping(seq, 5)
    for turn in range(1, len(holders)):
        holding = [h for h in holders if h.holding.is_set() and not h.release.is_set()]
        assert len(holding) == 1, [h.name for h in holding]  # one append at a time
        holding[0].release.set()
        deadline = time.monotonic() + WAIT_S
        while len(log) == turn:
            assert time.monotonic() < deadline, "the next append was never woken"
            time.sleep(0.001)
    _finish(*holders)
    assert sorted(log) == sorted(h.name for h in holders)
    assert seq._sleepers == 0 and not seq._writing and not +seq._waiting_writers


class _InterruptibleCondition(threading.Condition):
    """A condition whose wait() raises in the thread named `victim` once `interrupt` is set and it is woken."""

    def __init__(self, victim):
        super().__init__(threading.Lock())
        self.victim, self.interrupt = victim, threading.Event()

    def wait(self, timeout=None):
        woke = super().wait(timeout)
        if self.interrupt.is_set() and threading.current_thread().name == self.victim:
            raise KeyboardInterrupt("interrupted while waiting")
        return woke


def test_an_append_interrupted_while_waiting_lets_the_attends_behind_it_go():
    seq, log = _sequence(), []
    seq._written = _InterruptibleCondition("append")
    first = _Holder(log, "attend 1", reads=[(seq, 0)])
    first.start()
    assert first.holding.wait(WAIT_S)
    append = _Holder(log, "append", writes=[(seq, 0)])
    append.run = lambda: _swallow(_Holder.run, append)
    append.start()
    _sleeping(seq, 1)
    second = _Holder(log, "attend 2", reads=[(seq, 0)])  # held back by the waiting append
    second.start()
    _sleeping(seq, 2)
    with seq._written:  # wakes the append alone (the first waiter): attend 2 must be woken by the append's end
        seq._written.interrupt.set()
        seq._written.notify(1)
    assert second.holding.wait(WAIT_S), "the attend behind the interrupted append was never woken"
    append.join(WAIT_S)
    assert log == ["attend 1", "attend 2"] and not +seq._waiting_writers and not seq._writing
    _finish(first, second)


def _swallow(run, holder):
    try:
        run(holder)
    except KeyboardInterrupt:
        pass


@pytest.mark.parametrize("kind", ["writes", "reads"])
def test_a_wait_longer_than_the_timeout_raises_and_holds_nothing(kind):
    """A call's timeout bounds its wait for another call on the layer (it waited for as long as the other held it,
    whatever its timeout): DEADLINE_EXCEEDED once it passes, nothing taken, and the holder's end wakes no one."""
    import flashserve

    seq, log = _sequence(), []
    holder = _Holder(log, "holder", writes=[(seq, 0)])
    holder.start()
    assert holder.holding.wait(WAIT_S)
    start = time.monotonic()
    with pytest.raises(flashserve.DeadlineExceededError, match="layer 0"):
        with hold_layers(**{kind: [(seq, 1), (seq, 0)]}, timeout=0.3):
            log.append("waiter")
    waited = time.monotonic() - start
    assert 0.25 < waited < WAIT_S, waited
    assert seq._writing == {0} and seq._reading[1] == 0 and seq._waiting_writers[0] == 0, "the waiter held something"
    holder.release.set()
    holder.join(WAIT_S)
    assert log == ["holder"]
    with hold_layers(writes=[(seq, 0), (seq, 1)], timeout=1):  # free again, for anyone
        pass
