"""The console's web application: Starlette routes over `Console`, Jinja2 templates, one static script.

Safety: every state-changing request carries a CSRF token equal to its cookie (double submit) and, when
the page came from another origin, is refused; with a token set (TASKQ_CONSOLE_TOKEN) every page needs it,
given once on the login page or as a bearer token. A login gives a session cookie holding its expiry and an
HMAC of that expiry keyed by the token, never the token itself: it ends after `session_seconds` (12 h by
default), and changing the token ends every session.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from taskq._core.durations import parse_duration
from taskq._core.envelope import PRIORITIES
from taskq._core.errors import TaskqError
from taskq._core.settings import redact
from taskq.console.model import Console, DlqFilter
from taskq.consumer.dlq import ReplayResult

HERE = Path(__file__).resolve().parent
SESSION_COOKIE = "taskq_console"
CSRF_COOKIE = "taskq_csrf"
#: How long a login lasts, by default.
SESSION_SECONDS = 12 * 3600
#: Pages anyone may load: the login form and the static files.
OPEN_PATHS = ("/login", "/static/")

Endpoint = Callable[[Request], Awaitable[Response]]


def create_app(console: Console, *, token: str = "", session_seconds: float = SESSION_SECONDS) -> Starlette:
    """The console's ASGI application over `console`; `token` (if any) guards every page, and a login lasts
    `session_seconds`."""
    templates = Jinja2Templates(directory=str(HERE / "templates"))
    settings = console.settings

    def signature(expires: str) -> str:
        message = f"taskq-console-session:{expires}".encode()
        return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()

    def new_session() -> str:
        expires = str(int(time.time() + session_seconds))
        return f"{expires}.{signature(expires)}"

    def session_ok(cookie: str) -> bool:
        expires, _, sig = cookie.partition(".")
        if not expires.isdigit() or not hmac.compare_digest(sig.encode(), signature(expires).encode()):
            return False
        return int(expires) > time.time()

    def shown_error(exc: Exception) -> str:
        # Library errors may quote a setting back: never show a password, token or secret.
        secrets_ = [settings.schema_registry_password, settings.schema_registry_token, token]
        return redact(str(exc), settings.database_url, settings.schema_registry_url, secrets=secrets_)

    def page(request: Request, name: str, status: int = 200, **context: Any) -> Response:
        csrf = request.cookies.get(CSRF_COOKIE) or secrets.token_urlsafe(32)
        context.update(request=request, csrf=csrf, namespace=settings.namespace, tiers=PRIORITIES)
        response = templates.TemplateResponse(request, name, context, status_code=status)
        if request.cookies.get(CSRF_COOKIE) != csrf:
            response.set_cookie(CSRF_COOKIE, csrf, httponly=True, samesite="strict")
        return response

    def signed_in(request: Request) -> bool:
        if not token:
            return True
        bearer = request.headers.get("authorization", "")
        if bearer.startswith("Bearer ") and hmac.compare_digest(bearer[7:].encode(), token.encode()):
            return True
        return session_ok(request.cookies.get(SESSION_COOKIE, ""))

    async def csrf_ok(request: Request) -> bool:
        """The form's CSRF token equals its cookie, and the request comes from this console's own pages."""
        origin = request.headers.get("origin") or request.headers.get("referer")
        if origin and urlsplit(origin).netloc != request.headers.get("host", ""):
            return False
        form = await request.form()
        sent, kept = str(form.get("csrf", "")), request.cookies.get(CSRF_COOKIE, "")
        return bool(kept) and hmac.compare_digest(sent.encode(), kept.encode())

    def guarded(endpoint: Endpoint) -> Endpoint:
        """The endpoint behind the token (when set) and, for POST, the CSRF check."""

        async def wrapper(request: Request) -> Response:
            if not signed_in(request):
                if request.method == "GET" and not request.url.path.startswith("/api/"):
                    return RedirectResponse("/login", status_code=303)
                return JSONResponse({"error": "the console's token is needed"}, status_code=401)
            if request.method == "POST" and not await csrf_ok(request):
                return page(
                    request,
                    "message.html",
                    403,
                    title="Refused",
                    message="CSRF check failed: reload the page and try again.",
                )
            return await endpoint(request)

        return wrapper

    async def run(call: Callable[[], Any]) -> Any:
        from starlette.concurrency import run_in_threadpool

        return await run_in_threadpool(call)

    # ----------------------------------------------------------------------------------------------- pages
    def overview_in(template: str) -> Callable[[Request], Awaitable[Response]]:
        """The overview, as the whole page or as the fragment the page refreshes itself with."""

        async def overview(request: Request) -> Response:
            try:
                data = await run(console.overview)
            except TaskqError as exc:
                return page(request, template, 503, data=None, error=shown_error(exc))
            return page(request, template, data=data, error=None)

        return overview

    overview, overview_fragment = overview_in("overview.html"), overview_in("_overview.html")

    async def overview_json(request: Request) -> Response:
        try:
            return JSONResponse(await run(console.overview))
        except TaskqError as exc:
            return JSONResponse({"error": shown_error(exc)}, status_code=503)

    async def tasks(request: Request) -> Response:
        q = request.query_params.get("q", "").strip()
        record, error = None, None
        if q:
            try:
                record = await run(lambda: console.lookup(q))
            except TaskqError as exc:
                error = shown_error(exc)
        return page(request, "tasks.html", q=q, record=record, error=error)

    async def workflows(request: Request) -> Response:
        q = request.query_params.get("id", "").strip()
        tree, error = None, None
        if q:
            try:
                tree = await run(lambda: console.workflow(q))
            except TaskqError as exc:
                error = shown_error(exc)
        return page(request, "workflows.html", q=q, tree=tree, error=error)

    def dlq_filter(values: Any) -> tuple[DlqFilter, str | None]:
        since_text = str(values.get("since", "")).strip()
        try:
            since = parse_duration(since_text) if since_text else None
        except ValueError as exc:
            return DlqFilter(), f"since: {exc}"
        return (
            DlqFilter(
                task_type=str(values.get("type", "")).strip(),
                reason=str(values.get("reason", "")).strip(),
                error_type=str(values.get("error_type", "")).strip(),
                since=since,
                include_replayed=bool(values.get("replayed")),
            ),
            None,
        )

    async def dlq_page(
        request: Request, values: Any, results: list[ReplayResult] | None = None, error: str | None = None
    ) -> Response:
        f, bad = dlq_filter(values)
        records = []
        error = error or bad
        if bad is None:
            try:
                records = await run(lambda: console.dlq_list(f))
            except TaskqError as exc:
                error = shown_error(exc)
        return page(request, "dlq.html", records=records, f=values, results=results, error=error)

    async def dlq(request: Request) -> Response:
        return await dlq_page(request, request.query_params)

    async def dlq_record(request: Request) -> Response:
        offset = int(request.path_params["offset"])
        try:
            rec = await run(lambda: console.dlq_show(offset))
        except TaskqError as exc:
            return page(request, "message.html", 404, title="DLQ record", message=shown_error(exc))
        return page(request, "dlq_record.html", rec=rec)

    async def dlq_replay(request: Request) -> Response:
        form = await request.form()
        force = bool(form.get("force"))
        results: list[ReplayResult] | None = None
        error = None
        try:
            if form.get("scope") == "matching":
                f, bad = dlq_filter(form)
                if bad is not None:
                    raise TaskqError(bad)
                offsets = [r.offset for r in await run(lambda: console.dlq_list(f))]
            else:
                offsets = sorted({int(str(o)) for o in form.getlist("offset")})
            results = await run(lambda: console.replay(offsets, force=force))
        except (TaskqError, ValueError) as exc:
            error = shown_error(exc)
        return await dlq_page(request, form, results, error)

    async def pauses(request: Request) -> Response:
        message, error = None, None
        if request.method == "POST":
            form = await request.form()
            kind, name = str(form.get("kind", "")), str(form.get("name", ""))
            action = str(form.get("action", ""))
            try:
                if action == "pause":
                    changed = await run(lambda: console.pause(kind, name))
                    message = f"paused {kind} {name}" if changed else f"{kind} {name} was paused already"
                elif action == "resume":
                    changed = await run(lambda: console.resume(kind, name))
                    message = f"resumed {kind} {name}" if changed else f"{kind} {name} was not paused"
                else:
                    error = "action must be pause or resume"
            except TaskqError as exc:
                error = shown_error(exc)
        try:
            rows = await run(console.pauses)
        except TaskqError as exc:
            rows, error = [], shown_error(exc)
        return page(request, "pauses.html", pauses=rows, message=message, error=error)

    async def login(request: Request) -> Response:
        if request.method == "GET":
            return page(request, "login.html", error=None)
        if not await csrf_ok(request):
            return page(request, "login.html", 403, error="CSRF check failed: reload the page")
        form = await request.form()
        given = str(form.get("token", ""))
        if not token or not hmac.compare_digest(given.encode(), token.encode()):
            return page(request, "login.html", 401, error="wrong token")
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(
            SESSION_COOKIE,
            new_session(),
            max_age=int(session_seconds),
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return response

    async def headers(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        response = await call_next(request)
        # No framing, no script but the console's own file, nothing sent to other sites.
        response.headers["Content-Security-Policy"] = "default-src 'self'; frame-ancestors 'none'"
        response.headers["X-Frame-Options"] = "DENY"
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Cache-Control"] = "no-store"
        return response

    routes = [
        Route("/", guarded(overview)),
        Route("/overview/fragment", guarded(overview_fragment)),
        Route("/api/overview", guarded(overview_json)),
        Route("/tasks", guarded(tasks)),
        Route("/workflows", guarded(workflows)),
        Route("/dlq", guarded(dlq)),
        Route("/dlq/replay", guarded(dlq_replay), methods=["POST"]),
        Route("/dlq/{offset:int}", guarded(dlq_record)),
        Route("/pauses", guarded(pauses), methods=["GET", "POST"]),
        Route("/login", login, methods=["GET", "POST"]),
        Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
    ]
    app = Starlette(routes=routes, middleware=[Middleware(BaseHTTPMiddleware, dispatch=headers)])
    templates.env.filters["age"] = _age
    templates.env.filters["when"] = _when
    return app


def _age(seconds: float | None) -> str:
    """A duration for people: 4s, 3m 20s, 2h 5m."""
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60}s"
    return f"{s // 3600}h {s % 3600 // 60}m"


def _when(value: Any) -> str:
    """A timestamp without its microseconds."""
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat(timespec="seconds")
    if isinstance(value, str) and "." in value:
        head, _, tail = value.partition(".")
        return head + tail[6:] if len(tail) > 6 else head
    return "-" if value is None else str(value)
