"""The ``X-Laneway-*`` request headers, checked: a bad value is a 400 that names the header.

Values are bounded: they travel in every envelope, key Kafka records and Redis entries, and
end up in logs, so a header is never a way to make those grow.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from starlette.datastructures import Headers

from laneway.constants import Band
from laneway.errors import BadRequest

__all__ = [
    "DEADLINE_HEADER",
    "MAX_SEQ",
    "MAX_SESSION_CHARS",
    "PRIORITY_HEADER",
    "SEQ_HEADER",
    "SESSION_HEADER",
    "LanewayHeaders",
    "authorization",
    "single",
]

SESSION_HEADER = "x-laneway-session"
SEQ_HEADER = "x-laneway-seq"
PRIORITY_HEADER = "x-laneway-priority"
DEADLINE_HEADER = "x-laneway-deadline-ms"

MAX_SESSION_CHARS = 256  # a file path or a document URI; the session is the affinity key
MAX_SEQ = 2**63 - 1  # a signed 64-bit counter, as every client language has one
_MAX_DEADLINE_MS = 24 * 3600 * 1000  # longer ones change nothing: the class deadline is shorter
_DIGITS = re.compile(r"^[0-9]{1,19}$")  # int() would also take '+1', ' 1' and '1_000'
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True, slots=True)
class LanewayHeaders:
    session: str | None = None
    seq: int | None = None
    deadline_ms: int | None = None
    lower_band: bool = False  # X-Laneway-Priority: lo

    @classmethod
    def parse(cls, headers: Headers) -> LanewayHeaders:
        """The headers a request carries, or ``BadRequest`` naming the first bad one."""
        priority = single(headers, PRIORITY_HEADER)
        if priority is not None and priority not in ("hi", "lo"):
            raise BadRequest(
                f"header {PRIORITY_HEADER}: {priority[:20]!r} must be 'hi' or 'lo'",
                param=PRIORITY_HEADER,
            )
        return cls(
            session=_session(single(headers, SESSION_HEADER)),
            seq=_integer(single(headers, SEQ_HEADER), SEQ_HEADER, 0, MAX_SEQ),
            deadline_ms=_integer(
                single(headers, DEADLINE_HEADER), DEADLINE_HEADER, 1, _MAX_DEADLINE_MS
            ),
            lower_band=priority == "lo",
        )

    def band(self, tier: Band) -> Band:
        """The team's band, lowered by the header if it asked (a header never raises it)."""
        return "lo" if self.lower_band else tier


def single(headers: Headers, name: str) -> str | None:
    """The value of header ``name``, or ``BadRequest`` when it came more than once with
    different values: which one a proxy, the ingress and a log each read could differ (two
    keys, two sessions). A proxy that adds the same value again changes nothing."""
    values = headers.getlist(name)
    if len(set(values)) > 1:
        raise BadRequest(
            f"header {name} was sent {len(values)} times with different values: send it once",
            param=name,
        )
    return values[0] if values else None


def authorization(headers: Headers) -> str | None:
    return single(headers, "authorization")


def _session(raw: str | None) -> str | None:
    if raw is None:
        return None
    if not raw or len(raw) > MAX_SESSION_CHARS:
        raise BadRequest(
            f"header {SESSION_HEADER}: {len(raw)} characters; it must have 1 to "
            f"{MAX_SESSION_CHARS}",
            param=SESSION_HEADER,
        )
    if _CONTROL.search(raw):
        raise BadRequest(
            f"header {SESSION_HEADER}: control characters are not allowed", param=SESSION_HEADER
        )
    return raw


def _integer(raw: str | None, name: str, low: int, high: int) -> int | None:
    if raw is None:
        return None
    value = int(raw) if _DIGITS.match(raw) else None
    if value is None or not low <= value <= high:
        raise BadRequest(
            f"header {name}: {raw[:24]!r} must be a whole number from {low} to {high}",
            param=name,
        )
    return value
