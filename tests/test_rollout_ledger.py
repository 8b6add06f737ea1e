"""The rollout's ledger of draws (agentrl.rollout.ledger): pending tasks come before new ones, every draw
is counted once, a duplicate hand-over is caught, and the tasks in flight survive a checkpoint in the
order their groups would have reached the trainer."""

from __future__ import annotations

from agentrl.rollout.dataset import DatasetCursor, Draw
from agentrl.rollout.ledger import DrawLedger, GroupRun

TASKS = [{"id": i} for i in range(6)]


def _ledger(record: bool = True) -> DrawLedger:
    return DrawLedger(DatasetCursor(TASKS), record_outcomes=record)


def test_pending_draws_come_first_and_are_not_drawn_twice() -> None:
    ledger = _ledger()
    first = ledger.next_draw()
    assert first is not None and ledger.drawn == 1
    ledger.pending.append(first)  # e.g. a group too stale to train, to re-run
    assert ledger.next_draw() is first and ledger.drawn == 1
    assert ledger.next_draw() is not first and ledger.drawn == 2


def test_counts_balance_through_every_place() -> None:
    ledger = _ledger()
    draws = [ledger.next_draw() for _ in range(5)]
    a, b, c, d, e = (x for x in draws if x is not None)
    ledger.running[a.uid] = GroupRun(a, 0)
    ledger.running[b.uid] = GroupRun(b, 0)
    ledger.buffered[b.uid] = b  # finished, on its way into the buffer: counted once, as buffered
    ledger.buffered[c.uid] = c
    ledger.pending.append(d)
    assert ledger.taken(e.uid)
    counts = ledger.counts(dropped=0)
    assert counts == {
        "drawn": 5,
        "trained": 1,
        "dropped": 0,
        "running": 1,
        "buffered": 2,
        "pending": 1,
        "in_flight": 4,
        "balanced": 1,
    }
    assert ledger.counts(dropped=1)["balanced"] == 0  # one more than was drawn
    ledger.dropped("x", "zero_variance")
    assert ledger.outcomes == [(e.uid, "trained"), ("x", "dropped:zero_variance")]


def test_a_group_handed_over_twice_is_caught() -> None:
    ledger = _ledger(record=False)
    draw = ledger.next_draw()
    assert draw is not None
    ledger.buffered[draw.uid] = draw
    assert ledger.taken(draw.uid) and draw.uid not in ledger.buffered
    assert not ledger.taken(draw.uid)
    assert ledger.trained == 2 and ledger.outcomes == []  # counted, outcomes not kept


def test_in_flight_order_and_checkpoint_round_trip() -> None:
    ledger = _ledger()
    draws = [ledger.next_draw() for _ in range(6)]
    ahead, queued, open_, running, pending, trained = (x for x in draws if x is not None)
    ledger.buffered.update({queued.uid: queued, ahead.uid: ahead})
    ledger.running[open_.uid] = GroupRun(open_, 0)
    ledger.running[running.uid] = GroupRun(running, 0)
    pending.stale_requeues = 2
    ledger.pending.append(pending)
    ledger.taken(trained.uid)
    order = ledger.in_flight(queued=[queued.uid], open_batch=[open_.uid])
    assert [d.uid for d in order] == [ahead.uid, queued.uid, open_.uid, running.uid, pending.uid]

    state = ledger.state_dict(queued=[queued.uid], open_batch=[open_.uid])
    again = _ledger()
    again.load_state_dict(state)
    assert (again.drawn, again.trained) == (6, 1)
    assert [d.uid for d in again.pending] == [d.uid for d in order]
    assert again.pending[-1].stale_requeues == 2 and not again.running and not again.buffered
    assert again.next_draw().uid == ahead.uid  # type: ignore[union-attr]
    rest = [again.next_draw() for _ in range(4)]
    assert again.next_draw() is None and again.drawn == 6  # the cursor was exhausted at the checkpoint
    assert all(isinstance(d, Draw) for d in rest)
