"""`taskq console`: a web console over one namespace: overview, task lookup, DLQ explorer, pause/resume.

Its web parts (Starlette, Jinja2, uvicorn) come with the `console` extra; nothing here imports them until
the console is served.
"""

from __future__ import annotations

import ipaddress
import logging
import signal
from types import FrameType
from typing import Any

from taskq._core.errors import ConfigurationError
from taskq._core.settings import Settings

__all__ = ["INSTALL_HINT", "check_bind", "serve"]

INSTALL_HINT = "taskq console needs its extra: pip install 'kafka-taskq[console]'"
log = logging.getLogger("taskq.console")
#: What the `console` extra installs.
_WEB_MODULES = ("starlette", "jinja2", "uvicorn", "python_multipart")


def check_bind(host: str, token: str) -> None:
    """Refuse a non-loopback address without a token: anyone who reaches it could replay the DLQ."""
    if token or _loopback(host):
        return
    raise ConfigurationError(
        f"taskq console: refusing to listen on {host} without a token: set TASKQ_CONSOLE_TOKEN, "
        "or listen on 127.0.0.1"
    )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def serve(
    settings: Settings,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    token: str = "",
    session_hours: float = 12.0,
) -> None:
    """Serve the console until SIGINT/SIGTERM; a login lasts `session_hours`."""
    check_bind(host, token)
    try:
        import python_multipart  # noqa: F401  (Starlette reads forms with it, imported on first use)
        import uvicorn

        from taskq.console.app import create_app
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] in _WEB_MODULES:
            raise ConfigurationError(INSTALL_HINT) from None
        raise
    from taskq.console.model import Console

    console = Console(settings)
    try:
        console.start()
        app = create_app(console, token=token, session_seconds=session_hours * 3600)
        shown = f"[{host}]" if ":" in host else host
        if log.level == logging.NOTSET:
            log.setLevel(logging.INFO)  # a long-running command: its start line is shown
        started = ("taskq console: namespace %s on http://%s:%d/", settings.namespace, shown, port)

        class Server(uvicorn.Server):
            async def startup(self, sockets: Any = None) -> None:
                await super().startup(sockets)
                if self.started:
                    # Said once it listens, not before: a signal sent on seeing it reaches uvicorn's handlers.
                    # Sent earlier, it ended the command while uvicorn set its event loop up, and the loop's
                    # finalizer printed a line of its own at exit (not JSON under --log-format json).
                    log.info(*started)

        # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again under the handlers it
        # found. With this one the command ends with 0 like every other long-running one, not killed by the
        # signal; and a signal before uvicorn listens ends it at once.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, _exit_cleanly)
        # log_config=None: uvicorn's own lines go through the command's logging, JSON when asked.
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", access_log=False, log_config=None
        )
        Server(config).run()
    finally:
        console.close()
