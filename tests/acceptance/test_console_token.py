"""`taskq console` with TASKQ_CONSOLE_TOKEN: every page needs the token; a change, a CSRF check too."""

from __future__ import annotations

import http.cookiejar
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from taskq._core.settings import Settings
from tests.acceptance.helpers import console_process, wait_until

TOKEN = "s3cret-console-token"


@pytest.fixture
def console(env_of: Callable[..., dict[str, str]], settings: Settings, tmp_path: Path) -> Iterator[str]:
    env = env_of(TASKQ_CONSOLE_TOKEN=TOKEN)
    with console_process(env, tmp_path / "console.log", "--host", "127.0.0.1", probe="/login") as url:
        yield url


def status(
    opener: urllib.request.OpenerDirector, url: str, data: dict[str, str] | None = None, **headers: str
) -> int:
    body = urllib.parse.urlencode(data).encode() if data is not None else None
    try:
        with opener.open(urllib.request.Request(url, data=body, headers=headers), timeout=30) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_every_page_needs_the_token_and_a_change_a_csrf_token_as_well(console: str) -> None:
    jar = http.cookiejar.CookieJar()
    browser = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    assert status(browser, console + "/api/overview") == 401
    with browser.open(console + "/dlq", timeout=30) as r:  # redirected to the login page
        assert r.url.endswith("/login") and TOKEN not in r.read().decode()
    csrf = next(c.value for c in jar if c.name == "taskq_csrf")
    assert status(browser, console + "/login", {"csrf": csrf, "token": "wrong"}) == 401
    assert (
        status(browser, console + "/pauses", {"csrf": csrf, "kind": "tier", "name": "low", "action": "pause"})
        == 401
    )
    assert status(browser, console + "/login", {"csrf": csrf, "token": TOKEN}) == 200  # then the overview
    assert status(browser, console + "/api/overview") == 200
    assert TOKEN not in "".join(c.value for c in jar)  # the session cookie holds an HMAC, not the token
    forged = {"csrf": "forged", "kind": "tier", "name": "low", "action": "pause"}
    assert status(browser, console + "/pauses", forged) == 403
    other_site = {"csrf": csrf, "kind": "tier", "name": "low", "action": "pause"}
    assert status(browser, console + "/pauses", other_site, Origin="http://evil.example") == 403
    assert status(browser, console + "/pauses", other_site) == 200
    bearer = urllib.request.build_opener()
    assert status(bearer, console + "/api/overview", Authorization=f"Bearer {TOKEN}") == 200


def test_a_login_ends_when_its_session_expires_and_its_expiry_cannot_be_forged(
    env_of: Callable[..., dict[str, str]], settings: Settings, tmp_path: Path
) -> None:
    env = env_of(TASKQ_CONSOLE_TOKEN=TOKEN)
    args = ("--host", "127.0.0.1", "--session-hours", "0.001")  # 3.6 s
    with console_process(env, tmp_path / "console.log", *args, probe="/login") as console:
        jar = http.cookiejar.CookieJar()
        browser = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        browser.open(console + "/login", timeout=30).read()
        csrf = next(c.value for c in jar if c.name == "taskq_csrf")
        assert status(browser, console + "/login", {"csrf": csrf, "token": TOKEN}) == 200
        (session,) = [c for c in jar if c.name == "taskq_console"]
        assert session.expires is not None  # the browser forgets it too
        assert status(browser, console + "/api/overview") == 200
        # A later expiry with the old signature is refused.
        expires, _, sig = session.value.partition(".")
        forged = f"{int(expires) + 86400}.{sig}"
        assert status(urllib.request.build_opener(), console + "/api/overview", Cookie=f"taskq_console={forged}") == 401
        # The cookie itself, kept past its expiry (as a copied cookie would be), is refused once it ended.
        kept = f"taskq_console={session.value}"
        wait_until(
            lambda: status(urllib.request.build_opener(), console + "/api/overview", Cookie=kept) == 401,
            timeout=30,
            what="the session to end",
        )
