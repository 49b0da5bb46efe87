"""OpenAI's Files and Batches API: a team submits batch work with its API key, over HTTP.

Files and batches belong to the team of the key that made them: another team's is "not
found", exactly like one that does not exist.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable

from fastapi import APIRouter, Request
from starlette.datastructures import UploadFile
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ingress.batch_records import CreateBatch
from ingress.headers import authorization
from ingress.responses import JSONResponse
from ingress.state import IngressState
from laneway.batch import new_job_id
from laneway.errors import BadRequest
from laneway.openai_api import parse_body
from quota import Team

__all__ = ["FILES_PATH", "batch_router"]

batch_router = APIRouter(prefix="/v1")
FILES_PATH = "/v1/files"


async def _caller(request: Request) -> tuple[IngressState, Team]:
    state: IngressState = request.app.state.laneway
    caller = await state.callers.resolve(authorization(request.headers))
    return state, caller.team


@batch_router.post("/files")
async def create_file(request: Request) -> Response:
    """Upload a batch input file (multipart: ``file`` and ``purpose=batch``)."""
    state, team = await _caller(request)
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if kind != "multipart/form-data":
        raise BadRequest(
            f"a file is uploaded as multipart/form-data (fields 'file' and 'purpose'), "
            f"not {kind or 'a body with no Content-Type'}",
            param="file",
        )
    state.files.transfers.take(team.name)  # before the body: it is spooled as it comes
    try:
        async with request.form(max_files=1, max_fields=8) as form:
            purpose = form.get("purpose")
            upload = form.get("file")
            _known_fields_only(form.keys())
            if purpose != "batch":
                shown = purpose if isinstance(purpose, str) else None
                raise BadRequest(
                    f"purpose {shown!r} is not supported: laneway stores batch input files "
                    "only (purpose 'batch')",
                    param="purpose",
                )
            if not isinstance(upload, UploadFile):
                raise BadRequest(
                    "file: a multipart file field named 'file' is required", param="file"
                )
            record = await state.files.upload(team.name, upload.filename or "", upload.file)
    finally:
        state.files.transfers.give_back(team.name)
    return JSONResponse(record.public())


def _known_fields_only(fields: Iterable[str]) -> None:
    """A form field laneway does not read is refused, never dropped: the SDK's
    ``expires_after`` (``expires_after[anchor]``, ``expires_after[seconds]``) asks for a
    retention laneway does not keep (a file's bytes live on Kafka for its 7 days)."""
    for name in fields:
        if name in ("purpose", "file"):
            continue
        if name.startswith("expires_after"):
            raise BadRequest(
                "expires_after is not supported: laneway keeps an uploaded file for 7 days "
                "(its bytes on Kafka as long); leave it out",
                param="expires_after",
            )
        raise BadRequest(
            f"{name[:100]}: laneway does not know this field (fields 'file' and 'purpose')",
            param=name[:100],
        )


@batch_router.get("/files/{file_id}")
async def retrieve_file(file_id: str, request: Request) -> Response:
    state, team = await _caller(request)
    record = await state.files.get(file_id, team.name)
    return JSONResponse(record.public())


@batch_router.get("/files/{file_id}/content")
async def file_content(file_id: str, request: Request) -> Response:
    state, team = await _caller(request)
    record = await state.files.get(file_id, team.name)
    transfers = state.files.transfers
    transfers.take(team.name)
    try:
        content = state.files.content(record)
        # The first chunk is read before the answer starts: a backing service that fails
        # now is a 503, not a cut-off 200.
        first = await anext(content, b"")
    except BaseException:
        transfers.give_back(team.name)
        raise

    async def body() -> AsyncIterator[bytes]:
        yield first
        async for chunk in content:
            yield chunk

    return _Download(body(), lambda: transfers.give_back(team.name))


class _Download(StreamingResponse):
    """A file's bytes as they are read; ``ended`` runs once the answer ended however it
    ended (sent, the client gone before or during it)."""

    def __init__(self, content: AsyncIterator[bytes], ended: Callable[[], None]) -> None:
        super().__init__(content, media_type="application/octet-stream")
        self._ended = ended

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._ended()


@batch_router.post("/batches")
async def create_batch(request: Request) -> Response:
    state, team = await _caller(request)
    body = parse_body(CreateBatch, await request.body())
    record = await state.batches.create(team.name, body, new_job_id())
    return JSONResponse(record.public())


@batch_router.get("/batches")
async def list_batches(request: Request, after: str | None = None, limit: int = 20) -> Response:
    state, team = await _caller(request)
    if not 1 <= limit <= 100:
        raise BadRequest(f"limit {limit} is out of range 1 … 100", param="limit")
    return JSONResponse(await state.batches.page(team.name, after, limit))


@batch_router.get("/batches/{batch_id}")
async def retrieve_batch(batch_id: str, request: Request) -> Response:
    state, team = await _caller(request)
    return JSONResponse((await state.batches.get(batch_id, team.name)).public())


@batch_router.post("/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request) -> Response:
    state, team = await _caller(request)
    return JSONResponse((await state.batches.cancel(batch_id, team.name)).public())
