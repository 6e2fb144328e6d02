"""`taskq console` in a real headless Chromium (selenium, the system's chromedriver), over the real stack.

One namespace, one console process, one browser and one worker for the whole module; the tests run in
file order: the overview before any worker runs, then the DLQ, a replay, and a pause with the worker on.
Screenshots go to test-output/console/.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from taskq._core.envelope import PRIORITIES
from taskq._core.settings import Settings
from tests.acceptance.conftest import App
from tests.acceptance.helpers import WorkerProcess, console_process, wait_until
from tests.conftest import REPO, namespace_settings

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support.ui import Select  # noqa: E402

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
SHOTS = REPO / "test-output" / "console"

pytestmark = [
    pytest.mark.skipif(
        not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)),
        reason="needs Debian's chromium and chromium-driver (make test installs them)",
    ),
    # One console, browser and worker for the module, which its tests use in turn: under xdist they run on
    # one worker, in order.
    pytest.mark.xdist_group("console-browser"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def mod_settings(base_settings: Settings) -> Iterator[Settings]:
    """The module's own namespace: topics (2 partitions each) and database schema."""
    with namespace_settings(base_settings, "c" + uuid.uuid4().hex[:10], partitions=2) as s:
        yield s


@pytest.fixture(scope="module")
def env(mod_settings: Settings) -> Callable[..., dict[str, str]]:
    def make(**extra: str) -> dict[str, str]:
        return {
            **os.environ,
            "TASKQ_BOOTSTRAP_SERVERS": mod_settings.bootstrap_servers,
            "TASKQ_SCHEMA_REGISTRY_URL": mod_settings.schema_registry_url,
            "TASKQ_DATABASE_URL": mod_settings.database_url,
            "TASKQ_NAMESPACE": mod_settings.namespace,
            "TASKQ_DATABASE_SCHEMA": mod_settings.database_schema,
            "PYTHONPATH": str(REPO),
            **extra,
        }

    return make


@pytest.fixture(scope="module")
def app(
    mod_settings: Settings, env: Callable[..., dict[str, str]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[App]:
    a = App(mod_settings, env, tmp_path_factory.mktemp("console"))
    yield a
    a.close()


@pytest.fixture(scope="module")
def console(app: App, env: Callable[..., dict[str, str]]) -> Iterator[str]:
    """`taskq console` as a process on a free loopback port; its base URL."""
    with console_process(env(), app.tmp_path / "console.log", probe="/api/overview") as url:
        yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    SHOTS.mkdir(parents=True, exist_ok=True)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def worker(app: App) -> WorkerProcess:
    """One worker for the module, started by the first test that needs it."""
    return app.spawn("--concurrency", "4")


def texts(driver: WebDriver, css: str) -> list[str]:
    """The text of every element matching `css`, read in one script: the overview replaces its content
    every few seconds, and an element found before a refresh is gone after it."""
    script = "return Array.from(document.querySelectorAll(arguments[0])).map(e => e.innerText.trim())"
    return [str(t) for t in driver.execute_script(script, css)]


def text(driver: WebDriver, css: str) -> str:
    """The text of the first element matching `css`, once there is one (a submitted form's page loads)."""
    return wait_until(lambda: texts(driver, css), timeout=15, what=f"{css} on {driver.current_url}")[0]


def shoot(driver: WebDriver, name: str) -> Path:
    path = SHOTS / name
    driver.save_screenshot(str(path))
    return path


def stats(env: Callable[..., dict[str, str]]) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "taskq.cli", "stats", "--json"],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


# ------------------------------------------------------------------------------------------------- tests
def test_overview_shows_each_tiers_depth_as_taskq_stats_does(
    app: App, console: str, browser: WebDriver, env: Callable[..., dict[str, str]]
) -> None:
    app.enqueue_ledger([f"o{i}" for i in range(10)], copies=1)  # spread over the four tiers
    app.producer.enqueue(app.type("Ledger"), {"key": "later", "amount": 0}, delay=3600)
    app.producer.flush(30)
    browser.get(console + "/")
    expected = stats(env)["tiers"]
    assert all(expected[t] > 0 for t in PRIORITIES), expected
    shown = {t: int(text(browser, f'tr[data-tier="{t}"] .depth')) for t in PRIORITIES}
    assert shown == expected
    assert all(text(browser, f'tr[data-tier="{t}"] .oldest') != "-" for t in PRIORITIES)
    assert "1" in texts(browser, "#delay-tiers .waiting")
    # The overview refreshes itself: a new task shows without reloading the page.
    app.producer.enqueue(app.type("Ledger"), {"key": "o-new", "amount": 0}, priority="critical")
    app.producer.flush(30)
    wait_until(
        lambda: text(browser, 'tr[data-tier="critical"] .depth') == str(expected["critical"] + 1),
        timeout=15,
        what="the overview to refresh itself",
    )
    shoot(browser, "overview.png")


def test_a_dlq_records_detail_shows_its_decoded_payload(
    app: App, console: str, browser: WebDriver, worker: WorkerProcess
) -> None:
    with app.db.connection() as conn:
        conn.execute("INSERT INTO broken (key) VALUES ('acct-7')")
    app.producer.enqueue(
        app.type("Fragile"), {"key": "acct-7"}, idempotency_key="fragile:acct-7", max_attempts=1
    )
    app.producer.flush(30)
    browser.get(console + "/dlq")
    wait_until(
        lambda: browser.refresh() or browser.find_elements(By.CSS_SELECTOR, "#dlq-records tr[data-offset]"),
        timeout=60,
        what=f"the task in the DLQ\n{app.logs()}",
    )
    assert "partner for acct-7 is down" in text(browser, "#dlq-records")
    shoot(browser, "dlq.png")
    browser.find_element(By.CSS_SELECTOR, "#dlq-records tr[data-offset] a").click()
    assert json.loads(text(browser, "#payload")) == {"key": "acct-7"}
    assert text(browser, "#rec-task-type") == app.type("Fragile")
    assert "ConnectionError" in text(browser, "#traceback")
    shoot(browser, "dlq-record.png")


def test_a_replay_runs_once_and_a_second_replay_is_refused(
    app: App, console: str, browser: WebDriver, worker: WorkerProcess
) -> None:
    with app.db.connection() as conn:
        conn.execute("DELETE FROM broken WHERE key = 'acct-7'")  # the bug is fixed
    browser.get(console + "/dlq")
    offset = browser.find_element(By.CSS_SELECTOR, "#dlq-records tr[data-offset]").get_attribute(
        "data-offset"
    )
    browser.get(f"{console}/dlq/{offset}")
    browser.find_element(By.ID, "replay-button").click()
    assert "replayed" in text(browser, f'#replay-results li[data-offset="{offset}"]')
    wait_until(
        lambda: app.scalar("SELECT count(*) FROM ledger WHERE key = 'acct-7'") == 1,
        timeout=60,
        what=f"the replayed task to run\n{app.logs()}",
    )
    browser.get(f"{console}/dlq/{offset}")
    browser.find_element(By.ID, "replay-button").click()
    refused = text(browser, f'#replay-results li.refused[data-offset="{offset}"]')
    assert "already replayed" in refused and "force" in refused
    assert app.scalar("SELECT count(*) FROM ledger WHERE key = 'acct-7'") == 1
    # The task lookup shows the key's record: completed, on the replay's first attempt.
    browser.get(console + "/tasks")
    browser.find_element(By.NAME, "q").send_keys("fragile:acct-7\n")
    wait_until(lambda: browser.find_elements(By.ID, "task-state"), timeout=15, what="the lookup")
    assert text(browser, "#task-state") == "completed"
    assert text(browser, "#task-attempts") == "1"


def test_pausing_a_tier_holds_its_tasks_and_resuming_runs_each_once(
    app: App, console: str, browser: WebDriver, worker: WorkerProcess
) -> None:
    browser.get(console + "/pauses")
    Select(browser.find_element(By.CSS_SELECTOR, "#pause-tier select")).select_by_visible_text("low")
    browser.find_element(By.CSS_SELECTOR, "#pause-tier button").click()
    assert text(browser, "#message") == "paused tier low"
    assert browser.find_elements(By.CSS_SELECTOR, '#pauses tr[data-kind="tier"][data-name="low"]')
    wait_until(
        lambda: "paused tiers: low" in worker.output(), timeout=15, what="the worker to read the pause"
    )
    keys = [f"p{i}" for i in range(8)]
    for k in keys:
        app.producer.enqueue(app.type("Ledger"), {"key": k, "amount": 0}, priority="low")
    app.producer.enqueue(app.type("Ledger"), {"key": "marker", "amount": 0}, priority="normal")
    app.producer.flush(30)
    # The worker runs the other tiers meanwhile: the marker, enqueued after the low tasks, runs; they don't.
    wait_until(
        lambda: app.scalar("SELECT count(*) FROM ledger WHERE key = 'marker'") == 1,
        timeout=30,
        what="the normal tier to keep running",
    )
    assert app.scalar("SELECT count(*) FROM ledger WHERE key LIKE %s", "p%") == 0
    browser.get(console + "/")
    assert int(text(browser, 'tr[data-tier="low"] .depth')) >= len(keys)
    assert "paused" in text(browser, 'tr[data-tier="low"]')
    shoot(browser, "overview-paused.png")  # a worker alive, the low tier paused: the README's picture
    browser.get(console + "/pauses")
    browser.find_element(By.CSS_SELECTOR, '#pauses tr[data-name="low"] button.resume').click()
    assert text(browser, "#message") == "resumed tier low"
    wait_until(
        lambda: app.scalar("SELECT count(*) FROM ledger WHERE key LIKE %s", "p%") == len(keys),
        timeout=30,
        what=f"the low tier's tasks after the resume\n{app.logs()}",
    )
    app.assert_once_each([*keys, "marker"])  # and no key of the module ran twice


def test_pause_and_resume_from_the_cli(env: Callable[..., dict[str, str]]) -> None:
    def taskq(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "taskq.cli", *args], env=env(), capture_output=True, text=True, timeout=60
        )

    def paused() -> list[tuple[str, str]]:
        return [(r["kind"], r["name"]) for r in json.loads(taskq("pause", "--json").stdout)]

    assert taskq("pause", "--task-type", "demo.SendEmail").stdout.strip() == "paused task_type demo.SendEmail"
    assert taskq("pause", "--task-type", "demo.SendEmail").stdout.strip() == (
        "task_type demo.SendEmail was paused already"
    )
    assert ("task_type", "demo.SendEmail") in paused()
    assert taskq("resume", "--task-type", "demo.SendEmail").stdout.strip() == (
        "resumed task_type demo.SendEmail"
    )
    assert ("task_type", "demo.SendEmail") not in paused()
    refused = taskq("pause", "--task-type", " ")
    assert refused.returncode == 2 and refused.stderr.strip().count("\n") == 0, refused.stderr


def test_a_non_loopback_address_without_a_token_is_refused(env: Callable[..., dict[str, str]]) -> None:
    clean = {k: v for k, v in env().items() if k != "TASKQ_CONSOLE_TOKEN"}
    done = subprocess.run(
        [sys.executable, "-m", "taskq.cli", "console", "--host", "0.0.0.0", "--port", str(free_port())],
        env=clean,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "taskq: error: taskq console: refusing to listen on 0.0.0.0 without a token: set "
        "TASKQ_CONSOLE_TOKEN, or listen on 127.0.0.1"
    ]
