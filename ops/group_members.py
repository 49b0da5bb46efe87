"""A consumer group's members, seen and removed through Kafka's group protocol.

Workers are static members (their worker id is their ``group.instance.id``), and a static
member does not leave its group when it stops: its partitions wait for the session timeout
before another member takes them. A worker stopped for good (the local autoscaler's scale
in) is therefore removed by its id, as ``kafka-consumer-groups --delete`` does (KIP-345:
LeaveGroup v3 names members by instance id), so its partitions move on at once.
aiokafka 0.14 has neither that request nor a working DescribeGroups v3, hence the two small
request types here.
"""

from __future__ import annotations

from typing import Any

from aiokafka.client import AIOKafkaClient
from aiokafka.errors import for_code
from aiokafka.protocol.admin import DescribeGroupsRequest_v2
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import Array, Int16, Int32, Schema, String

__all__ = ["GroupMembers"]

_GROUP_COORDINATOR = 0  # FindCoordinator's key type for consumer groups


class _LeaveGroupResponseV3(Response):  # type: ignore[misc]
    API_KEY = 13
    API_VERSION = 3
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        ("error_code", Int16),
        (
            "members",
            Array(
                ("member_id", String("utf-8")),
                ("group_instance_id", String("utf-8")),
                ("error_code", Int16),
            ),
        ),
    )


class _LeaveGroupRequestV3(RequestStruct):  # type: ignore[misc]
    API_KEY = 13
    API_VERSION = 3
    RESPONSE_TYPE = _LeaveGroupResponseV3
    SCHEMA = Schema(
        ("group_id", String("utf-8")),
        ("members", Array(("member_id", String("utf-8")), ("group_instance_id", String("utf-8")))),
    )


class _LeaveByInstanceId(Request[_LeaveGroupRequestV3]):  # type: ignore[misc]
    API_KEY = 13

    def __init__(self, group: str, instance_ids: list[str]) -> None:
        self.group = group
        self.instance_ids = instance_ids

    def build(self, request_struct_class: type[_LeaveGroupRequestV3]) -> Any:
        # An empty member id: "whichever member runs under this instance id".
        return request_struct_class(self.group, [("", i) for i in self.instance_ids])


class _DescribeGroups(Request[DescribeGroupsRequest_v2]):  # type: ignore[misc]
    """Pinned to v2: aiokafka 0.14 reads a v3 answer with v2's layout and fails."""

    API_KEY = 15

    def __init__(self, groups: list[str]) -> None:
        self.groups = groups

    def build(self, request_struct_class: type[DescribeGroupsRequest_v2]) -> Any:
        return request_struct_class(self.groups)


class GroupMembers:
    """Counts and removes consumer-group members (``start``/``stop`` or ``async with``)."""

    def __init__(self, bootstrap: str, **auth: Any) -> None:
        self.bootstrap = bootstrap
        self._auth = auth  # SASL options of the principal (laneway.clients.kafka_auth)
        self._client: AIOKafkaClient | None = None

    async def start(self) -> None:
        await self._connected()

    async def _connected(self) -> AIOKafkaClient:
        if self._client is None:
            client = AIOKafkaClient(
                bootstrap_servers=self.bootstrap, request_timeout_ms=5000, **self._auth
            )
            await client.bootstrap()
            self._client = client
        return self._client

    async def stop(self) -> None:
        """Close the connection; safe twice."""
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    async def __aenter__(self) -> GroupMembers:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _send(self, group: str, request: Any) -> Any:
        client = await self._connected()
        node = await client.coordinator_lookup(_GROUP_COORDINATOR, group)
        return await client.send(node, request)

    async def count(self, group: str) -> int:
        """Members of ``group`` now (0 for a group with none, or unknown)."""
        response = await self._send(group, _DescribeGroups([group]))
        for found in response.to_object()["groups"]:
            if found["group"] == group:
                if found["error_code"]:
                    raise for_code(found["error_code"])(f"describing group {group}")
                return len(found["members"])
        return 0

    async def remove(self, group: str, instance_ids: list[str]) -> list[str]:
        """Remove static members from ``group`` by their instance ids, in one rebalance;
        the ids that were members (the others left, or their session expired already)."""
        response = await self._send(group, _LeaveByInstanceId(group, instance_ids))
        answer = response.to_object()
        if answer["error_code"]:
            raise for_code(answer["error_code"])(f"removing {instance_ids} from {group}")
        return [m["group_instance_id"] for m in answer["members"] if m["error_code"] == 0]
