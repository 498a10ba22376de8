"""Staleness policies and push idempotence, with exact numbers."""

from __future__ import annotations

import pytest

from dniasync.train.staleness import Decision, PushLedger, PushVerdict, StalenessPolicy


def test_none_policy_applies_everything_with_full_lr() -> None:
    policy = StalenessPolicy("none")
    assert policy.decide(0.1, 10, 10) == Decision(True, 0.1, 0)
    assert policy.decide(0.1, 10, 0) == Decision(True, 0.1, 10)


@pytest.mark.parametrize(("now", "on", "lr"), [(5, 5, 0.4), (5, 4, 0.4), (5, 3, 0.2), (5, 1, 0.1), (100, 0, 0.004)])
def test_inverse_policy_divides_lr_by_staleness(now: int, on: int, lr: float) -> None:
    decision = StalenessPolicy("inverse").decide(0.4, now, on)
    assert decision.apply and decision.staleness == now - on
    assert decision.lr == pytest.approx(lr)


def test_bound_policy_drops_pushes_staler_than_the_bound() -> None:
    policy = StalenessPolicy("bound", max_staleness=2)
    assert policy.decide(0.1, 7, 5) == Decision(True, 0.1, 2)
    assert policy.decide(0.1, 7, 4) == Decision(False, 0.0, 3)


def test_bad_policies_and_future_versions_are_errors() -> None:
    with pytest.raises(ValueError, match="unknown staleness policy 'sometimes'"):
        StalenessPolicy("sometimes")
    with pytest.raises(ValueError, match="newer than the shard"):
        StalenessPolicy().decide(0.1, 3, 4)


def test_ledger_applies_each_push_once_and_fences_zombies() -> None:
    ledger = PushLedger()
    assert ledger.check("r0", 1, 1) is PushVerdict.NEW
    ledger.record("r0", 1, 1)
    assert ledger.check("r0", 1, 1) is PushVerdict.DUPLICATE
    assert ledger.check("r0", 1, 0) is PushVerdict.DUPLICATE
    assert ledger.check("r0", 1, 2) is PushVerdict.NEW
    ledger.record("r0", 2, 1)  # the replica restarted: new incarnation
    assert ledger.check("r0", 1, 99) is PushVerdict.ZOMBIE
    assert ledger.check("r0", 2, 2) is PushVerdict.NEW
    assert ledger.check("r1", 1, 1) is PushVerdict.NEW
    restored = PushLedger.restore(ledger.snapshot())
    assert restored.check("r0", 2, 1) is PushVerdict.DUPLICATE
    assert restored.check("r0", 1, 5) is PushVerdict.ZOMBIE
