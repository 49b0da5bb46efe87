"""The batch lane over HTTP: the OpenAI Files and Batches API of an ingress, for the CLI.

What a tenant uses: its API key is all it holds (no Kafka credentials); the ingress writes
the lines for the key's team. Any OpenAI client does the same (``client.files.create``,
``client.batches.create``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from laneway.errors import BadRequest, LanewayError, NotFound, ServiceError, Unauthorized

__all__ = ["HttpBatchClient"]

_DONE = ("completed", "failed", "expired", "cancelled")


class HttpBatchClient:
    """Submits, follows and fetches batches through ``base_url`` (``…/v1``)."""

    def __init__(self, base_url: str, api_key: str, timeout_s: float = 300.0) -> None:
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=timeout_s,
        )

    async def __aenter__(self) -> HttpBatchClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    async def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            url = str(self._http.base_url).rstrip("/") + path
            raise ServiceError(
                f"{method} {url}: {exc!r}; is the ingress there? (LANEWAY_INGRESS_URL, or "
                "unset, the local stack's on LANEWAY_PORT)"
            ) from exc
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:500]
            kind: type[LanewayError] = {401: Unauthorized, 404: NotFound}.get(
                response.status_code, BadRequest if response.status_code < 500 else ServiceError
            )
            raise kind(f"{method} {path}: {response.status_code}: {message}")
        return response

    async def submit(self, path: Path, endpoint: str, metadata: dict[str, str]) -> dict[str, Any]:
        """Upload ``path`` and create a batch of it; the batch object."""
        with path.open("rb") as fh:
            uploaded = await self._call(
                "POST",
                "/files",
                files={"file": (path.name, fh, "application/jsonl")},
                data={"purpose": "batch"},
            )
        body = {
            "input_file_id": uploaded.json()["id"],
            "endpoint": endpoint,
            "completion_window": "24h",
            "metadata": metadata,
        }
        batch: dict[str, Any] = (await self._call("POST", "/batches", json=body)).json()
        return batch

    async def batch(self, batch_id: str) -> dict[str, Any]:
        found: dict[str, Any] = (await self._call("GET", f"/batches/{batch_id}")).json()
        return found

    async def results(self, batch_id: str) -> bytes:
        """The output and error lines of a finished batch (OpenAI's output format)."""
        batch = await self.batch(batch_id)
        if batch["status"] not in _DONE:
            counts = batch["request_counts"]
            raise BadRequest(
                f"batch {batch_id} is {batch['status']} ({counts['completed'] + counts['failed']}"
                f"/{counts['total']} done): its results come when it has finished"
            )
        out = b""
        for file_id in (batch["output_file_id"], batch["error_file_id"]):
            if file_id:
                out += (await self._call("GET", f"/files/{file_id}/content")).content
        return out

    @staticmethod
    def finished(batch: dict[str, Any]) -> bool:
        return batch["status"] in _DONE
