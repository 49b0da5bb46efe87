"""Wrong admin keys, counted: past a burst of them, no admin key is judged for a while.

The admin key opens the admin API and the web console, and `/readyz` shows its checks to
it: whoever reaches a replica could try keys as fast as it answers. Each replica lets
``burst`` wrong keys through at once and one more every ``refill_s`` after that. Past them
every admin key, the right one too, is answered 429 until a try is due: judging it would
tell a guesser. Per replica and in memory, so N replicas let N times as many through, which
at one a second each is still nothing against a key made as the README says (`openssl rand
-hex 24`).
"""

from __future__ import annotations

import hmac
import math
import time
from collections.abc import Callable

from laneway.apikeys import KEY_PREFIX
from laneway.errors import AdminKeyGuesses

__all__ = ["AdminGuesses"]


class AdminGuesses:
    def __init__(
        self,
        *,
        burst: int = 20,
        refill_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.burst = burst
        self.refill_s = refill_s
        self._clock = clock
        self._tries = float(burst)  # wrong keys that may come now
        self._at = clock()

    def matches(self, given: str, expected: str) -> bool:
        """Whether ``given`` is ``expected`` (the admin key); ``AdminKeyGuesses`` while
        wrong keys have used up the tries. An empty one is no try, and neither is a team's
        API key (``lw-``, which no admin key starts with): a tenant whose monitor sends its
        key to /readyz must not keep the admin out."""
        if not given or not expected or given.removeprefix("Bearer ").startswith(KEY_PREFIX):
            return False
        now = self._clock()
        self._tries = min(self.burst, self._tries + (now - self._at) / self.refill_s)
        self._at = now
        if self._tries < 1:
            wait_s = (1 - self._tries) * self.refill_s
            raise AdminKeyGuesses(
                f"too many wrong admin keys were tried on this replica; the next is judged "
                f"in {math.ceil(wait_s)} s",
                team="",
                limit=self.burst,
                retry_after=wait_s,
            )
        if hmac.compare_digest(
            given.encode(errors="surrogatepass"), expected.encode(errors="surrogatepass")
        ):
            return True
        self._tries -= 1
        return False
