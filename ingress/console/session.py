"""Console logins: the admin key, given once at the login form, buys a signed, expiring
session cookie (HttpOnly, SameSite=Strict); every form carries a token derived from it.

Sessions are stateless: a cookie is ``<expires>.<nonce>.<signature>``, signed with a secret
derived from the admin key, so every replica with the same key accepts it, and changing the
key ends every session. The key itself never travels again, and never in a URL.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["COOKIE", "ConsoleSession", "ConsoleSessions"]

COOKIE = "laneway_console"
_SALT = b"laneway console session v1"


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


@dataclass(frozen=True, slots=True)
class ConsoleSession:
    nonce: str
    expires: int


class ConsoleSessions:
    def __init__(
        self, admin_key: str, ttl_s: float, *, clock: Callable[[], float] = time.time
    ) -> None:
        self._secret = hmac.new(admin_key.encode(), _SALT, hashlib.sha256).digest()
        self.ttl_s = ttl_s
        self.clock = clock

    def _sign(self, payload: str) -> str:
        return _b64(hmac.new(self._secret, payload.encode(), hashlib.sha256).digest())

    def issue(self) -> str:
        """A new session's cookie value."""
        payload = f"{int(self.clock() + self.ttl_s)}.{secrets.token_urlsafe(16)}"
        return f"{payload}.{self._sign(payload)}"

    def verify(self, cookie: str | None) -> ConsoleSession | None:
        """The session of a cookie that is well signed and not expired, else None."""
        if not cookie or len(cookie) > 200:
            return None
        expires, _, rest = cookie.partition(".")
        nonce, _, signature = rest.partition(".")
        if not (expires.isdigit() and nonce and signature):
            return None
        expected = self._sign(f"{expires}.{nonce}")
        if not hmac.compare_digest(signature.encode(errors="surrogatepass"), expected.encode()):
            return None
        if int(expires) <= self.clock():
            return None
        return ConsoleSession(nonce=nonce, expires=int(expires))

    def csrf_token(self, session: ConsoleSession) -> str:
        """The token every form of this session carries (a cross-site page cannot read it)."""
        return self._sign(f"csrf.{session.nonce}")

    def csrf_ok(self, session: ConsoleSession, token: str) -> bool:
        return hmac.compare_digest(
            token.encode(errors="surrogatepass"), self.csrf_token(session).encode()
        )
