"""The FastAPI application: its lifespan owns the Kafka producer and the Redis pool."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from ingress.admin import admin_router
from ingress.admin_canary import canary_router
from ingress.admin_shadow import shadow_router
from ingress.batch_routes import FILES_PATH, batch_router
from ingress.completions import HOT_ROUTES
from ingress.console import Console, install_console
from ingress.errors import install_error_handlers
from ingress.limits import BodyLimit
from ingress.routes import router
from ingress.settings import IngressSettings
from ingress.state import IngressState
from laneway.watchdog import AliveFile

__all__ = ["create_app"]


def create_app(settings: IngressSettings) -> FastAPI:
    """An ingress app for ``settings``; clients start and stop with the app's lifespan."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The sign of life first: a start that blocks the loop is as hung as a run that does.
        async with AliveFile(settings.watchdog_file):
            # Kafka clients bind to the running loop: build them inside the lifespan.
            state = IngressState(settings)
            await state.start()
            app.state.laneway = state
            # The console (on with the admin key) follows its Kafka feed from its first page.
            console = Console(settings) if settings.admin_key.get_secret_value() else None
            app.state.console = console
            try:
                yield
            finally:
                if console is not None:
                    await console.stop()
                await state.stop()

    # No /docs, /redoc or /openapi.json: they listed the admin routes to every tenant, and
    # the API a client uses is OpenAI's, documented where it is.
    app = FastAPI(
        title="laneway ingress",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    install_error_handlers(app)
    # An upload carries its multipart framing on top of the file.
    upload_limit = settings.max_file_bytes + 64 * 1024
    app.add_middleware(
        BodyLimit, max_bytes=settings.max_body_bytes, per_path={FILES_PATH: upload_limit}
    )
    app.router.routes.extend(HOT_ROUTES)  # tried before the included routers
    app.include_router(router)
    app.include_router(batch_router)
    app.include_router(admin_router)
    app.include_router(canary_router)
    app.include_router(shadow_router)
    install_console(app)
    return app
