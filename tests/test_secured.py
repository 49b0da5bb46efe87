"""Kafka and Redis as trust boundaries, on a broker with SASL/SCRAM and the ACL authorizer
and a Redis with ACL users (the ``secured_services`` pair, started for these tests only).

Each principal gets what ``laneway principals create --role ...`` gives it, and the tests
check both sides: what a role may do works, what it may not is refused by the broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import orjson
import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import (
    GroupAuthorizationFailedError,
    KafkaError,
    TopicAuthorizationFailedError,
    TransactionalIdAuthorizationFailed,
)
from openai.types import Batch
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from laneway.batch import BatchClient
from laneway.clients import make_admin
from laneway.constants import TEAM_TOPIC_PARTITION_BYTES, Topics
from laneway.errors import ConfigError, ServiceError
from laneway.kafka_acl import has_scram, upsert_scram
from laneway.schema import BatchRequest
from laneway.settings import CommonSettings, load_settings
from ops.broker_admin import BrokerAdmin
from ops.principals import Role, acl_rules, create_principal, show_acls
from tests.secured import Principals, SecuredServices
from tests.stack import LiveStack, eventually
from tests.test_streams_process import StreamsProcess, produce_usage, usage_event


@pytest.fixture
async def secured(
    secured_services: SecuredServices, prefix: str
) -> AsyncIterator[tuple[LiveStack, Principals]]:
    assert secured_services.services is not None
    live = LiveStack(secured_services.services, prefix)
    await live.create_topics()
    try:
        yield live, Principals(secured_services, live)
    finally:
        await live.stop()


async def _produce(auth: dict[str, object], bootstrap: str, topic: str, value: bytes) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, request_timeout_ms=10_000, **auth)
    try:
        await producer.start()
        await producer.send_and_wait(topic, value, key=b"k")
    finally:
        await producer.stop()


async def _read_one(auth: dict[str, object], bootstrap: str, topic: str, **options: object) -> None:
    """Fetch from ``topic`` from its start until a record comes or the broker refuses."""
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        **options,  # type: ignore[arg-type]
        **auth,  # type: ignore[arg-type]
    )
    try:
        await consumer.start()
        for _ in range(50):
            batches = await consumer.getmany(timeout_ms=200)
            if any(batches.values()):
                return
        raise AssertionError(f"nothing read from {topic}")
    finally:
        await consumer.stop()


def _batch_line(job: str, line: str, **fields: object) -> bytes:
    body = {
        "model": "laneway-chat",
        "messages": [{"role": "user", "content": f"summarise {line}"}],
        "max_tokens": 8,
    }
    return BatchRequest(job_id=job, line_id=line, body=body, **fields).to_json()  # type: ignore[arg-type]


def _http_line(i: int) -> bytes:
    body = {
        "model": "laneway-chat",
        "messages": [{"role": "user", "content": f"summarise doc {i}"}],
        "max_tokens": 8,
    }
    line = {"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/chat/completions"}
    return orjson.dumps({**line, "body": body})


async def _until_done(client: openai.AsyncOpenAI, batch_id: str, within_s: float = 120) -> Batch:
    deadline = time.monotonic() + within_s
    while True:
        batch = await client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        if time.monotonic() > deadline:
            raise TimeoutError(f"batch {batch_id} still {batch.status} after {within_s}s")
        await asyncio.sleep(0.2)


async def test_tenant_writes_its_own_batch_topic_and_nothing_internal(
    secured: tuple[LiveStack, Principals],
) -> None:
    stack, principals = secured
    topics, bootstrap = stack.topics, stack.services.bootstrap
    await principals.create("pay", "tenant:payments")
    await principals.create("ads", "tenant:ads")
    auth = principals.auth("pay")

    await _produce(auth, bootstrap, topics.batch_team("payments"), _batch_line("j", "1"))
    # Another team's batch input, the ingress's batch lane, the reply and request topics.
    for forbidden in (
        topics.batch_team("ads"),
        topics.request("batch"),
        topics.replies,
        topics.request("completion", "hi"),
        topics.usage,
        topics.cancel,
    ):
        with pytest.raises(TopicAuthorizationFailedError):
            await _produce(auth, bootstrap, forbidden, b"{}")


async def test_a_tenants_topics_hold_a_bounded_share_of_the_brokers_disk(
    secured: tuple[LiveStack, Principals],
) -> None:
    """A tenant principal writes its batch topic as fast as the broker takes it: only the
    topics' own bound keeps it from filling the disk every team's traffic needs."""
    stack, principals = secured
    await principals.create("flood", "tenant:flood")
    client = make_admin(CommonSettings(**stack.common))
    await client.start()
    try:
        for topic in (stack.topics.batch_team("flood"), stack.topics.results_batch_team("flood")):
            [response] = await client.describe_configs(
                [ConfigResource(ConfigResourceType.TOPIC, topic)]
            )
            entries = response.to_object()["resources"][0]["config_entries"]
            config = {e["config_names"]: e["config_value"] for e in entries}
            assert int(config["retention.bytes"]) == TEAM_TOPIC_PARTITION_BYTES, topic
            assert int(config["segment.bytes"]) < TEAM_TOPIC_PARTITION_BYTES, topic
    finally:
        await client.close()


async def test_tenant_cannot_read_requests_or_another_teams_results(
    secured: tuple[LiveStack, Principals],
) -> None:
    stack, principals = secured
    topics, bootstrap = stack.topics, stack.services.bootstrap
    await principals.create("pay", "tenant:payments")
    await principals.create("ads", "tenant:ads")
    producer = await stack.producer()  # the admin: something to read on every topic
    for topic in (
        topics.request("completion", "hi"),
        topics.request("batch"),
        topics.results_batch,
        topics.results_batch_team("ads"),
        topics.usage,
    ):
        await producer.send_and_wait(topic, b"{}", key=b"k")
    await producer.send_and_wait(topics.results_batch_team("payments"), b"{}", key=b"k")

    auth = principals.auth("pay")
    await _read_one(auth, bootstrap, topics.results_batch_team("payments"))
    for forbidden in (
        topics.request("completion", "hi"),
        topics.request("batch"),
        topics.batch_team("payments"),  # its own input: written, never read back
        topics.results_batch,
        topics.results_batch_team("ads"),
        topics.usage,
    ):
        with pytest.raises(TopicAuthorizationFailedError):
            await _read_one(auth, bootstrap, forbidden)
    # A consumer group outside its own prefix is refused too.
    with pytest.raises(GroupAuthorizationFailedError):
        await _read_one(
            auth, bootstrap, topics.results_batch_team("payments"), group_id="laneway-workers"
        )
    await _read_one(
        auth,
        bootstrap,
        topics.results_batch_team("payments"),
        group_id=f"{stack.prefix}.team.payments.results",
    )


async def test_analyst_reads_usage_and_nothing_else(
    secured: tuple[LiveStack, Principals],
) -> None:
    stack, principals = secured
    topics, bootstrap = stack.topics, stack.services.bootstrap
    await principals.create("analyst", "analyst")
    producer = await stack.producer()
    for topic in (
        topics.usage,
        topics.usage_hourly,
        topics.results_batch,
        topics.request("chat", "hi"),
        topics.replies,
        topics.control,
    ):
        await producer.send_and_wait(topic, b"{}", key=b"k")

    auth = principals.auth("analyst")
    await _read_one(auth, bootstrap, topics.usage)
    await _read_one(auth, bootstrap, topics.usage_hourly)
    for forbidden in (topics.results_batch, topics.request("chat", "hi"), topics.replies):
        with pytest.raises(TopicAuthorizationFailedError):
            await _read_one(auth, bootstrap, forbidden)
    for forbidden in (topics.usage, topics.control):  # forged usage feeds billing
        with pytest.raises(TopicAuthorizationFailedError):
            await _produce(auth, bootstrap, forbidden, b"{}")


async def test_service_principals_serve_the_whole_path(
    secured: tuple[LiveStack, Principals], secured_services: SecuredServices
) -> None:
    """Ingress → completion worker → reply, and a tenant's batch line → result, each
    component as its own Kafka principal and Redis user; the batch line's team is its
    topic's, whatever the line claims."""
    stack, principals = secured
    topics = stack.topics
    await principals.create("ingress", "ingress")
    await principals.create("completion", "worker:completion")
    await principals.create("batch", "worker:batch")
    await principals.create("pay", "tenant:payments")

    ingress = await stack.start_ingress(**principals.settings("ingress", "ingress"))
    await stack.start_worker("completion", **principals.settings("completion", "worker"))
    await stack.start_worker("batch", **principals.settings("batch", "worker"))
    key = await stack.api_key("team-a")
    client = stack.sdk(ingress, key)
    result = await client.completions.create(
        model="laneway-code", prompt="def add(a, b):", max_tokens=8
    )
    assert result.choices[0].text.strip()

    # The line names team-a and carries a valid key of it: were it believed, team-a would pay.
    line = _batch_line("job-pay", "doc-1", api_key=key, team="team-a")
    await _produce(
        principals.auth("pay"), stack.services.bootstrap, topics.batch_team("payments"), line
    )
    (found,) = await stack.read_topic(topics.results_batch_team("payments"), count=1)
    assert (found["job_id"], found["line_id"], found["team"], found["status"]) == (
        "job-pay",
        "doc-1",
        "payments",
        "ok",
    )
    usage = await stack.read_topic(
        topics.usage, count=1, where=lambda e: e["id"] == found["request_id"]
    )
    assert usage[0]["team"] == "payments"
    # The shared results topic holds none of it: only its team reads this result.
    assert not await stack.read_all(topics.results_batch, where=lambda r: r["job_id"] == "job-pay")

    # The Batches API over HTTP: the ingress writes the lines in its own transaction, the
    # batch pool answers, the ingress reads the results back.
    jsonl = b"".join(_http_line(i) + b"\n" for i in range(2))
    uploaded = await client.files.create(file=("docs.jsonl", jsonl), purpose="batch")
    batch = await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = await _until_done(client, batch.id)
    assert done.status == "completed", done
    assert done.output_file_id is not None
    output = (await client.files.content(done.output_file_id)).content.splitlines()
    assert sorted(orjson.loads(line)["custom_id"] for line in output) == ["doc-0", "doc-1"]


async def test_a_worker_is_confined_to_its_pool(secured: tuple[LiveStack, Principals]) -> None:
    stack, principals = secured
    topics, bootstrap = stack.topics, stack.services.bootstrap
    await principals.create("chat", "worker:chat")
    auth = principals.auth("chat")
    producer = await stack.producer()
    await producer.send_and_wait(topics.request("completion", "hi"), b"{}", key=b"k")
    with pytest.raises(TopicAuthorizationFailedError):
        await _read_one(auth, bootstrap, topics.request("completion", "hi"))
    with pytest.raises(TopicAuthorizationFailedError):
        await _produce(auth, bootstrap, topics.request("batch"), b"{}")
    # Batch results are written in transactions of the batch pool's ids alone.
    txn = AIOKafkaProducer(
        bootstrap_servers=bootstrap, transactional_id=f"{stack.prefix}.batch.x", **auth
    )
    with pytest.raises(TransactionalIdAuthorizationFailed):
        await txn.start()
    with contextlib.suppress(KafkaError):
        await txn.stop()


async def test_principals_get_exactly_the_table(secured: tuple[LiveStack, Principals]) -> None:
    stack, principals = secured
    name = await principals.create("pay", "tenant:payments")
    held = await show_acls(CommonSettings(**stack.common), name)
    assert held == sorted(acl_rules(name, Role.parse("tenant:payments"), stack.topics))
    assert {rule.name for rule in held} == {
        f"{stack.prefix}.req.batch.team.payments",
        f"{stack.prefix}.results.batch.team.payments",
        f"{stack.prefix}.team.payments.",
    }


async def test_a_principal_created_again_under_another_role_is_refused(
    secured: tuple[LiveStack, Principals],
) -> None:
    """ACLs are only ever added: a tenant of one team created again for another kept its
    first team's rights beside the new ones."""
    stack, principals = secured
    name = await principals.create("moving", "tenant:alpha")
    await principals.create("moving", "tenant:alpha")  # the same role again: fine
    with pytest.raises(ConfigError, match=r"holds \d+ ACLs its role tenant:beta does not grant"):
        await principals.create("moving", "tenant:beta")
    held = await show_acls(CommonSettings(**stack.common), name)
    assert held == sorted(acl_rules(name, Role.parse("tenant:alpha"), stack.topics))


async def test_creating_a_principal_never_takes_over_the_admins_or_another_login(
    secured: tuple[LiveStack, Principals],
) -> None:
    """A typo'd or careless name must not replace the password of the super user running the
    command, nor of a login laneway did not make: its new owner would hold its rights."""
    stack, _ = secured
    admin = CommonSettings(**stack.common)
    with pytest.raises(ConfigError, match="is the one this command runs as"):
        await create_principal(admin, admin.kafka_username, Role.parse("tenant:acme"))
    outsider = f"{stack.prefix}-outsider"  # a credential with no ACLs, as a super user has
    client = make_admin(admin)
    await client.start()
    try:
        await upsert_scram(client, outsider, "the-outsiders-password")
        # The controller has it; the broker that answers describes it a moment later.
        await eventually(lambda: has_scram(client, outsider), 15, "the credential to show")
    finally:
        await client.close()
    with pytest.raises(ConfigError, match="exists and holds no ACLs"):
        await create_principal(admin, outsider, Role.parse("analyst"))
    # Refused before anything changed: the admin still logs in, the outsider's ACLs are none.
    assert await show_acls(admin, outsider) == []
    await create_principal(admin, outsider, Role.parse("analyst"), replace=True)
    assert await show_acls(admin, outsider) == acl_rules(
        outsider, Role.parse("analyst"), stack.topics
    )


async def test_a_batch_service_submits_a_job_in_one_transaction(
    secured: tuple[LiveStack, Principals],
) -> None:
    stack, principals = secured
    await principals.create("svc", "batch-service")
    settings = CommonSettings(**{**stack.common, **principals.settings("svc")})
    lines = [_http_line(i).decode() for i in range(3)]
    async with BatchClient(settings) as client:
        job = await client.submit(lines, team="payments")
        assert (await client.status(job)).lines == 3


async def test_the_batch_service_cannot_read_or_finish_a_teams_http_batch(
    secured: tuple[LiveStack, Principals],
) -> None:
    """An operator's pipeline writes req.batch and reads results.batch. HTTP batches have
    topics of their own: a batch service that could read or write their results could read
    every team's batch output, or finish a team's batch with results of its making (it
    did, before they moved)."""
    stack, principals = secured
    topics, bootstrap = stack.topics, stack.services.bootstrap
    await principals.create("svc", "batch-service")
    producer = await stack.producer()  # the admin: something to read
    await producer.send_and_wait(topics.results_batch_http, b"{}", key=b"batch_x")
    auth = principals.auth("svc")
    for topic in (topics.batch_http, topics.results_batch_http):
        with pytest.raises(TopicAuthorizationFailedError):
            await _produce(auth, bootstrap, topic, b"{}")
    with pytest.raises(TopicAuthorizationFailedError):
        await _read_one(auth, bootstrap, topics.results_batch_http)


async def test_redis_refuses_the_default_user_and_foreign_keys(
    secured_services: SecuredServices,
) -> None:
    anonymous = aioredis.Redis.from_url(secured_services.anonymous_redis_url)
    try:
        with pytest.raises((AuthenticationError, ResponseError)):
            await anonymous.set("t-anything", b"1")
    finally:
        await anonymous.aclose()
    worker = aioredis.Redis.from_url(secured_services.redis_url("worker"))
    try:
        await worker.set("tprefix:quota:x", b"1")  # under a laneway prefix: its own
        with pytest.raises(NoPermissionError):
            await worker.set("someone-else:key", b"1")
        with pytest.raises(NoPermissionError):
            await worker.flushall()
    finally:
        await worker.aclose()
    wrong = aioredis.Redis.from_url(
        secured_services.redis_url("worker").replace("worker:", "worker:x", 1)
    )
    try:
        with pytest.raises(AuthenticationError):
            await wrong.ping()
    finally:
        await wrong.aclose()


def test_no_password_in_settings_repr() -> None:
    settings = CommonSettings(
        kafka_security_protocol="SASL_PLAINTEXT",
        kafka_username="ingress",
        kafka_password="hunter2-hunter2",
    )
    assert "hunter2" not in repr(settings)
    assert "hunter2" not in orjson.dumps(settings.model_dump(mode="json")).decode()


async def test_streams_principal_rolls_usage_up_for_the_analyst(
    secured: tuple[LiveStack, Principals], tmp_path: Path
) -> None:
    """The Faust app as the streams principal (its group, its changelog topics, which it
    creates itself) folds a worker's usage into the hourly rollup the analyst reads."""
    stack, principals = secured
    topics = stack.topics
    await principals.create("streams", "streams")
    await principals.create("completion", "worker:completion")
    await principals.create("analyst", "analyst")
    streams = StreamsProcess(
        stack,
        tmp_path,
        rollup_idle_s=0.5,
        rollup_grace_s=0,
        **principals.settings("streams", "streams"),
    )
    await streams.start()
    try:
        producer = AIOKafkaProducer(
            bootstrap_servers=stack.services.bootstrap, **principals.auth("completion")
        )
        try:
            await producer.start()
            await produce_usage(producer, topics.usage, [usage_event(ts=time.time() - 7200)])
        finally:
            await producer.stop()
        consumer = AIOKafkaConsumer(
            topics.usage_hourly,
            bootstrap_servers=stack.services.bootstrap,
            auto_offset_reset="earliest",
            group_id=f"{stack.prefix}.analyst.rollups",
            **principals.auth("analyst"),
        )
        try:
            await consumer.start()
            record = await asyncio.wait_for(consumer.getone(), 60)
        finally:
            await consumer.stop()
        rollup = orjson.loads(record.value)
        assert (rollup["team"], rollup["requests"]) == ("team-a", 1)
    finally:
        code = await streams.stop()
    assert code == 0, streams.log()


def test_a_sasl_protocol_without_a_login_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LANEWAY_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("LANEWAY_KAFKA_PASSWORD", "hunter2-hunter2")
    with pytest.raises(ConfigError) as refused:
        load_settings(CommonSettings)
    assert "LANEWAY_KAFKA_USERNAME" in str(refused.value)
    assert "hunter2" not in str(refused.value)


def test_secured_broker_refuses_data_formatted_without_its_admin(tmp_path: Path) -> None:
    logs = tmp_path / "kafka-logs"
    logs.mkdir()
    (logs / "meta.properties").write_text("cluster.id=x\n")
    admin = BrokerAdmin("admin", "first-password")
    with pytest.raises(ServiceError, match="without SASL"):
        admin.check_formatted(logs)
    admin.mark_formatted(logs)
    admin.check_formatted(logs)
    with pytest.raises(ServiceError, match="another admin password"):
        BrokerAdmin("admin", "second-password").check_formatted(logs)
    with pytest.raises(ServiceError, match="with admin 'admin'"):
        BrokerAdmin("root", "first-password").check_formatted(logs)
    assert "first-password" not in (logs / "laneway-sasl-admin").read_text()


def test_batch_topics_name_their_team_and_only_theirs() -> None:
    topics = Topics("laneway")
    pattern = re.compile(topics.batch_pattern())
    assert topics.team_of_batch_topic("laneway.req.batch.team.payments") == "payments"
    assert topics.team_of_batch_topic("laneway.req.batch") is None
    assert topics.team_of_batch_topic("other.req.batch.team.payments") is None
    assert topics.batch_results_for("laneway.req.batch.team.ads") == (
        "laneway.results.batch.team.ads"
    )
    assert topics.batch_results_for("laneway.req.batch") == "laneway.results.batch"
    for consumed in ("laneway.req.batch", "laneway.req.batch.team.payments"):
        assert pattern.match(consumed)
    for other in ("laneway.req.batchx", "laneway.req.batch.team.", "laneway.results.batch"):
        assert not pattern.match(other)
    with pytest.raises(ConfigError, match=re.escape("tenant:a.b")):
        Role.parse("tenant:a.b")  # a dot would make one team's topic prefix another's
