"""The one backoff every reconnect loop waits with: jittered, doubling, capped, resettable."""

from __future__ import annotations

import pytest

from laneway.retry import Backoff


def test_waits_double_with_jitter_up_to_the_ceiling_and_reset() -> None:
    backoff = Backoff(0.2, 1.0)
    steps = [0.2, 0.4, 0.8, 1.0, 1.0]
    for step in steps:
        wait = backoff.next_wait()
        assert step / 2 <= wait <= step
    backoff.reset()
    assert 0.1 <= backoff.next_wait() <= 0.2


def test_processes_that_failed_together_do_not_retry_in_step() -> None:
    waits = {round(Backoff(1.0, 1.0).next_wait(), 6) for _ in range(50)}
    assert len(waits) > 40


def test_a_backoff_without_room_is_refused() -> None:
    with pytest.raises(ValueError, match="first_s"):
        Backoff(2.0, 1.0)
