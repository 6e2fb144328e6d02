"""`taskq console` refusals that need no service: a non-loopback address without a token, a missing extra."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from taskq._core.errors import ConfigurationError
from taskq.console import check_bind


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_needs_no_token(host: str) -> None:
    check_bind(host, "")


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "console.example.com"])
def test_any_other_address_needs_a_token(host: str) -> None:
    with pytest.raises(ConfigurationError, match="TASKQ_CONSOLE_TOKEN"):
        check_bind(host, "")
    check_bind(host, "a-token")


def test_without_the_extra_the_command_says_how_to_install_it() -> None:
    # uvicorn made unimportable, as in an installation without kafka-taskq[console].
    code = (
        "import sys; sys.modules['uvicorn'] = None; from taskq.cli import main; sys.exit(main(['console']))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TASKQ_CONSOLE_TOKEN"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "taskq: error: taskq console needs its extra: pip install 'kafka-taskq[console]'"
    ]
