"""A bench or chaos run's scratch namespace: when the run fails and its clean-up fails too (the outage that
broke the run often breaks the clean-up), the run's own error is the one reported."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import replace
from urllib.parse import urlsplit, urlunsplit

import pytest

from taskq._core.db import Database
from taskq._core.settings import Settings
from taskq.tools.bench import scratch_namespace


@contextmanager
def tcp_forwarder(host: str, port: int) -> Iterator[tuple[int, Callable[[], None]]]:
    """A TCP forwarder to host:port on a local port, and a function that cuts every connection and refuses
    new ones, as a network outage would."""
    listener = socket.create_server(("127.0.0.1", 0))
    conns: list[socket.socket] = []

    def pipe(src: socket.socket, dst: socket.socket) -> None:
        with suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)

    def accept() -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            upstream = socket.create_connection((host, port))
            conns.extend((client, upstream))
            threading.Thread(target=pipe, args=(client, upstream), daemon=True).start()
            threading.Thread(target=pipe, args=(upstream, client), daemon=True).start()

    def cut() -> None:
        with suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept: close alone keeps it listening
        listener.close()
        for c in conns:
            with suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1], cut
    finally:
        cut()


def test_the_run_error_is_reported_when_the_clean_up_fails_as_well(base_settings: Settings) -> None:
    url = urlsplit(base_settings.database_url)
    assert url.hostname and url.port
    schemas: list[str] = []
    try:
        with tcp_forwarder(url.hostname, url.port) as (port, cut):
            netloc = url.netloc.replace(f"{url.hostname}:{url.port}", f"127.0.0.1:{port}")
            s = replace(base_settings, database_url=urlunsplit(url._replace(netloc=netloc)))
            # The run's error, not the clean-up's "Postgres unreachable".
            with pytest.raises(RuntimeError, match="the run failed"):
                with scratch_namespace(s, "probe", partitions=1) as run:
                    schemas.append(run.database_schema)
                    cut()
                    raise RuntimeError("the run failed")
    finally:
        for schema in schemas:  # left behind, as the warning says
            Database(base_settings.database_url, schema=schema).drop_schema()
