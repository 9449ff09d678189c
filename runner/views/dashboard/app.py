"""The dashboard's web app (Starlette): two pages and the JSON they poll, read-only.

    GET /                  the jobs list (static/index.html), polling /api/jobs
    GET /job/NAME          one job (static/job.html), polling /api/jobs/NAME
    GET /api/jobs          {"storage", "jobs": [row, ...], "error"}      (runner.views.dashboard.data)
    GET /api/jobs/NAME     {"row", "status", "attempts", "steps", "samples", "log", "error", ...}
    GET /static/...        the pages' script and style, and uPlot (vendored, with its license)

Every answer carries an ETag (the data's version): a page that polls sends If-None-Match and gets
304 while nothing changed. Storage is read in a worker thread with a time limit, so a slow bucket
never blocks the event loop; past the limit the page says so in one line.

Who may look: with a token (GRPO_RUN_DASHBOARD_TOKEN), every request must carry it, as
`Authorization: Bearer TOKEN`, or once as `?token=TOKEN`, which sets an HttpOnly cookie for the
rest. Pages are built in the browser with textContent only (storage's text is never HTML), under a
Content-Security-Policy that allows this server's own scripts and nothing else.
"""

from __future__ import annotations

import asyncio
import hmac
import zlib
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from grpo_run.runner.views.dashboard.data import Bucket

STATIC = Path(__file__).parent / "static"
READ_LIMIT_S = 20.0       # a storage read the page waits for at most
COOKIE = "grpo_run_dashboard"
HEADERS = {"Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
                                      "frame-ancestors 'none'",
           "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


def create_app(bucket: Bucket, *, token: str | None = None, read_limit_s: float = READ_LIMIT_S) -> Starlette:
    """The app over `bucket`; with `token`, every request must carry it (see the module's doc)."""

    async def read(fn, *args) -> tuple[Any, int] | str:
        try:
            return await asyncio.wait_for(asyncio.to_thread(fn, *args), read_limit_s)
        except TimeoutError:
            return f"storage did not answer within {read_limit_s:g} s; showing what was read before"

    def answer(request: Request, body: dict[str, Any], version: int) -> Response:
        # the records' version, and what is read besides them on every request (the error, the local log)
        etag = f'W/"{version}-{zlib.crc32(repr((body.get("error"), body.get("log"))).encode()):x}"'
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers={"ETag": etag, **HEADERS})
        return JSONResponse(body, headers={"ETag": etag, **HEADERS})

    async def jobs(request: Request) -> Response:
        got = await read(bucket.jobs)
        if isinstance(got, str):
            return JSONResponse({"storage": bucket.storage, "jobs": None, "error": got}, headers=HEADERS)
        return answer(request, *got)

    async def job(request: Request) -> Response:
        got = await read(bucket.job, request.path_params["name"])
        if isinstance(got, str):
            return JSONResponse({"row": None, "error": got}, headers=HEADERS)
        page, version = got
        if page is None:
            return JSONResponse({"error": f"no job {request.path_params['name']!r} in {bucket.storage}"},
                                status_code=404, headers=HEADERS)
        return answer(request, page, version)

    def page(name: str):
        async def serve(request: Request) -> Response:
            return FileResponse(STATIC / name, headers=HEADERS)
        return serve

    app = Starlette(routes=[Route("/", page("index.html")), Route("/job/{name}", page("job.html")),
                            Route("/api/jobs", jobs), Route("/api/jobs/{name}", job),
                            Mount("/static", StaticFiles(directory=STATIC), name="static")])
    if token:
        app.add_middleware(_TokenGate, token=token)
    return app


class _TokenGate:
    """Refuses a request without the token (401) or with another (403), compared in constant time;
    `?token=` on a first load sets a cookie and redirects to the same page without it (the token
    leaves the address bar and the history)."""

    def __init__(self, app, token: str) -> None:
        self.app, self.token = app, token.encode()

    def _is(self, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given.encode(), self.token)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = Request(scope)
        said = request.headers.get("authorization", "")
        bearer = said[7:] if said.lower().startswith("bearer ") else None
        if self._is(bearer) or self._is(request.cookies.get(COOKIE)):
            return await self.app(scope, receive, send)
        if "token" in request.query_params:
            if not self._is(request.query_params["token"]):
                return await PlainTextResponse("wrong token", status_code=403, headers=HEADERS)(scope, receive, send)
            back = RedirectResponse(request.url.remove_query_params("token").path or "/", status_code=303)
            back.set_cookie(COOKIE, self.token.decode(), httponly=True, samesite="strict")
            return await back(scope, receive, send)
        given = bearer or request.cookies.get(COOKIE)
        text, code = (("wrong token", 403) if given else
                      ("this dashboard needs its token: open it as /?token=TOKEN (GRPO_RUN_DASHBOARD_TOKEN)", 401))
        await PlainTextResponse(text, status_code=code, headers=HEADERS)(scope, receive, send)
