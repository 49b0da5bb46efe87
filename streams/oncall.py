"""The on-call webhook: one POST per breaker transition into level 2 or above, and per canary
rolled back."""

from __future__ import annotations

import asyncio
import logging

import httpx

from streams.records import BreakerTransition, CanaryChange

__all__ = ["OnCallWebhook"]

log = logging.getLogger(__name__)

_ATTEMPTS = 3
_TIMEOUT_S = 5.0


class OnCallWebhook:
    """POSTs transitions to ``LANEWAY_BREAKER_WEBHOOK_URL`` in the background.

    A failed connection is retried (the request never left); any other failure is logged and
    not retried, so the receiver never gets the same transition twice.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self._client: httpx.AsyncClient | None = None
        self._pending: set[asyncio.Task[None]] = set()
        self.sent = 0

    def notify(self, transition: BreakerTransition | CanaryChange) -> None:
        if not self.url:
            return
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=_TIMEOUT_S)
        task = asyncio.create_task(self._post(self._client, transition))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _post(
        self, client: httpx.AsyncClient, transition: BreakerTransition | CanaryChange
    ) -> None:
        body = {"text": transition.summary(), **transition.model_dump(mode="json", by_alias=True)}
        for attempt in range(1, _ATTEMPTS + 1):
            try:
                response = await client.post(self.url, json=body)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                log.warning("on-call webhook unreachable (attempt %d): %s", attempt, exc)
                await asyncio.sleep(0.5 * attempt)
                continue
            except httpx.HTTPError as exc:
                log.warning("on-call webhook failed for %s: %s", transition.subject, exc)
                return
            if response.is_error:
                log.error(
                    "on-call webhook answered %d for %s", response.status_code, transition.subject
                )
            else:
                self.sent += 1
            return
        log.error("on-call webhook %s unreachable; %s not delivered", self.url, transition.subject)

    async def aclose(self) -> None:
        if self._pending:
            await asyncio.wait(self._pending, timeout=_TIMEOUT_S)
        if self._client is not None:
            await self._client.aclose()
            self._client = None
