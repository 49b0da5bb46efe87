"""A team's record changed by an admin (``quota.set_team``: ``laneway teams set``, the admin
API) is used at once by the ingress, not when its cached copy expires; while Redis does not
answer, the copy it had still serves. ``laneway teams set`` changes only what it is given."""

from __future__ import annotations

from urllib.parse import urlsplit

from laneway.cache import TtlCache
from laneway.constants import RedisKeys
from quota import Team, set_team
from quota.teams import get_team
from tests.stack import LiveStack, eventually
from tests.tcp_proxy import TcpProxy


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


async def test_a_change_announced_while_the_ingress_could_not_hear_is_used_after(
    stack: LiveStack,
) -> None:
    """The announcement is lost on an ingress cut off from Redis (a partition, a restart);
    once it reaches Redis again it reads every team anew, not when its copies expire."""
    target = urlsplit(stack.services.redis_url)
    proxy = TcpProxy(target.hostname or "127.0.0.1", target.port or 6379)
    await proxy.start()
    try:
        # The key first: its own announcement comes before the ingress follows.
        key = await stack.api_key("payments", size=1)
        ingress = await stack.start_ingress(redis_url=proxy.url())
        callers = ingress.state.callers
        callers._teams.ttl_s = 600.0  # only the follower can bring the change in within bound
        channel = ingress.state.keys.team_changes()
        await eventually(lambda: _listeners(stack, channel), 10, "the ingress to follow")
        assert (await callers.resolve(f"Bearer {key}")).team.size == 1
        await proxy.cut_off()
        await eventually(
            lambda: _listeners(stack, channel, 0), 10, "Redis to see the follower gone"
        )
        # Made on Redis itself (the admin reaches it; this ingress does not): nobody hears.
        await set_team(stack.redis, ingress.state.keys, Team("payments", size=12))
        assert callers._teams.get("payments") is not None, "the copy must be fresh here"
        assert (await callers.resolve(f"Bearer {key}")).team.size == 1  # its copy serves
        proxy.mend()

        async def changed() -> bool:
            return (await callers.resolve(f"Bearer {key}")).team.size == 12

        await eventually(changed, 30, "the ingress to use the record changed while cut off")
    finally:
        await proxy.stop()


async def _listeners(stack: LiveStack, channel: str, count: int = 1) -> bool:
    [(_, live)] = await stack.redis.pubsub_numsub(channel)
    return live == count


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


async def test_teams_set_changes_only_the_fields_it_is_given(stack: LiveStack) -> None:
    # An operator turning type-through off must not also reset the team's budget and tier.
    code, out = await stack.cli(
        "teams", "set", "payments", "--size", "12", "--complexity", "1.2", "--tier", "lo"
    )
    assert code == 0, out
    code, out = await stack.cli("teams", "set", "payments", "--no-type-through")
    assert code == 0, out
    keys = RedisKeys(stack.prefix)
    assert await get_team(stack.redis, keys, "payments") == Team(
        "payments", size=12, complexity=1.2, tier="lo", type_through=False
    )
    code, out = await stack.cli("teams", "show", "payments")
    assert (code, out.strip()) == (
        0,
        "team payments: size 12, complexity 1.2, tier lo, supersede grace 0 tokens, "
        "type-through off",
    )
    # A new team has no stored size to keep: it must be given, and nothing is stored without.
    code, out = await stack.cli("teams", "set", "newcomers", "--tier", "lo")
    assert code == 2, out
    assert "'newcomers' does not exist yet: give its --size" in out
    assert not await stack.redis.sismember(keys.teams(), "newcomers")
    code, out = await stack.cli("teams", "show", "newcomers")
    assert code == 2, out
    assert "no team 'newcomers'" in out
