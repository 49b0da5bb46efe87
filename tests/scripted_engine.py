"""A sim engine the test steps: it takes no time, counts its runs by request id, and can hold a
run at a chosen token until the request is aborted or the test lets it go."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator

from workers.sim import SimEngine, SimProfile
from workers.types import EngineDelta, EngineRequest

__all__ = ["ScriptedSim"]


class ScriptedSim(SimEngine):
    """The sim engine (taking no time), counting its runs by request id, answering the prompts
    in ``answers`` with those words (one a token). The first run of a request named in
    ``hold`` keeps back its token of that index until the request is aborted or ``let_go`` is
    called. The sim's abort takes effect at its next step: a run kept back at its last token
    ends as it would have, as when an abort comes during the last step."""

    def __init__(self) -> None:
        super().__init__(SimProfile(prefill_ms_per_token=0.0, decode_ms_per_step=0.0))
        self.answers: dict[str, list[str]] = {}
        self.runs: Counter[str] = Counter()
        self.hold: dict[str, int] = {}
        self.holding: set[str] = set()
        self.aborts: set[str] = set()
        self._free = False
        self._changed = asyncio.Condition()

    def _completion_words(self, request: EngineRequest) -> list[str]:
        return self.answers.get(request.prompt) or super()._completion_words(request)

    async def abort(self, request_id: str) -> None:
        self.aborts.add(request_id)
        await super().abort(request_id)
        async with self._changed:
            self._changed.notify_all()

    async def let_go(self) -> None:
        self._free = True
        async with self._changed:
            self._changed.notify_all()

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineDelta]:
        self.runs[request.id] += 1
        at = self.hold.pop(request.id, None)
        async with contextlib.aclosing(super().generate(request)) as deltas:
            index = 0
            async for delta in deltas:
                if index == at:
                    self.holding.add(request.id)
                    async with self._changed:
                        await self._changed.wait_for(
                            lambda: self._free or request.id in self.aborts
                        )
                    self.holding.discard(request.id)
                yield delta
                index += 1
