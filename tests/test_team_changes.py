"""A team's record changed by an admin (``quota.set_team``: ``laneway teams set``, the admin
API) is used at once by the ingress, not when its cached copy expires; while Redis does not
answer, the copy it had still serves."""

from __future__ import annotations

from laneway.cache import TtlCache
from quota import Team, set_team
from tests.stack import LiveStack, eventually


async def test_the_ingress_uses_a_changed_team_record_at_once(stack: LiveStack) -> None:
    ingress = await stack.start_ingress()
    key = await stack.api_key("payments", size=1)
    callers = ingress.state.callers
    # Cached a minute here (4 s in service): only the announcement can bring the change in
    # within the test's bound.
    callers._teams.ttl_s = 60.0
    assert (await callers.resolve(f"Bearer {key}")).team.size == 1
    await set_team(stack.redis, ingress.state.keys, Team("payments", size=12, tier="lo"))

    async def changed() -> bool:
        team = (await callers.resolve(f"Bearer {key}")).team
        return (team.size, team.tier) == (12, "lo")

    await eventually(changed, 10, "the ingress to use the new record")


def test_a_record_expired_by_its_change_stays_the_fallback() -> None:
    """Expired early, a cached record is read again, yet still serves as the last known one
    while the store does not answer; a read begun before the change is not cached."""
    teams: TtlCache[str] = TtlCache(60.0)
    teams.put("payments", "old")
    before = teams.changes
    teams.expire("payments")
    assert teams.get("payments") is None
    assert teams.get("payments", stale_ok=True) == "old"
    teams.put_if(before, "payments", "read before the change")
    assert teams.get("payments") is None
    teams.put_if(teams.changes, "payments", "new")
    assert teams.get("payments") == "new"
    teams.expire(None)
    assert (teams.get("payments"), teams.get("payments", stale_ok=True)) == (None, "new")
