"""The code blocks of the docs' tutorial and how-to pages, and a runner that executes them in order.

Every fenced block of those pages carries a marker comment on the line before it (blank lines between are
allowed), saying how CI covers it:

- `<!-- run -->`: executed in order: a Python block in the test's process (the page's blocks share one
  namespace, as in an interpreter session), a shell block by bash in the page's directory.
- `<!-- run: background -->`: a shell block started in the background (a worker), stopped at the end.
- `<!-- run: restart -->`: the background processes are stopped (SIGTERM, as Ctrl-C would), then this one
  starts in the background.
- `<!-- file: NAME -->`: the block is written to NAME in the page's directory (a later `file:` of the same
  NAME is the edited file).
- `<!-- test: tests/PATH.py::test_name -->`: not executed; the named test runs what the block shows.

A marker may end with `#ID`, a name the test uses to stop after that block (`page.run_until("ID")`) and
check what it did before going on.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<lang>[\w+-]*)[^\n]*$")
_MARKER = re.compile(
    r"^\s*<!--\s*(?P<kind>run|file|test)(?::\s*(?P<arg>[^#]*?))?\s*(?:#(?P<id>[\w-]+))?\s*-->\s*$"
)


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page, with its marker."""

    page: str
    line: int
    lang: str
    code: str
    kind: str  # run, file, test; "" when the block has no marker
    arg: str
    id: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.lang or 'no language'})"


def blocks(page: str | Path) -> list[Block]:
    """The fenced blocks of a docs page (a path relative to docs/, or absolute), in order."""
    path = DOCS / page
    rel = path.relative_to(DOCS).as_posix()
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m["indent"]), m["fence"], m["lang"]
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][indent:] if not lines[j][:indent].strip() else lines[j].lstrip())
            j += 1
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = _MARKER.match(lines[k]) if k >= 0 else None
        found.append(
            Block(
                page=rel,
                line=i + 1,
                lang=lang,
                code="\n".join(body) + "\n",
                kind=marker["kind"] if marker else "",
                arg=(marker["arg"] or "").strip() if marker else "",
                id=(marker["id"] or "") if marker else "",
            )
        )
        i = j + 1
    return found


def covered_pages() -> list[str]:
    """The pages whose every code block must be covered: the tutorial and the how-to guides."""
    return ["tutorial.md", *sorted(p.relative_to(DOCS).as_posix() for p in (DOCS / "how-to").glob("*.md"))]


class PageRun:
    """Runs the `run` and `file` blocks of one page in `workdir`, with `env` for commands and Python.

    `rename` is applied to every block first: tests map the page's Avro namespace onto their own, so the
    task types they register are deleted with the test's namespace.
    """

    def __init__(
        self,
        page: str,
        workdir: Path,
        env: Mapping[str, str],
        *,
        rename: Callable[[str], str] = lambda text: text,
        setenv: Callable[[str, str], Any] | None = None,
    ) -> None:
        self.blocks = [b for b in blocks(page) if b.kind in ("run", "file")]
        self.workdir = workdir
        self.env = {**env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"}
        self.rename = rename
        self.namespace: dict[str, Any] = {"__name__": "__docs__"}
        self.outputs: dict[str, str] = {}  # block id -> what it printed (shell blocks)
        self.background: list[tuple[subprocess.Popen[bytes], Any]] = []
        self._next = 0
        if setenv is not None:  # Python blocks run in this process: they see the page's environment
            for name, value in self.env.items():
                if os.environ.get(name) != value:
                    setenv(name, value)

    def run_until(self, block_id: str) -> None:
        """Run the blocks up to and including the one marked `#block_id`."""
        if not any(b.id == block_id for b in self.blocks[self._next :]):
            raise KeyError(f"no block #{block_id} left to run")
        while True:
            block = self.blocks[self._next]
            self._run(block)
            self._next += 1
            if block.id == block_id:
                return

    def run_rest(self) -> None:
        """Run every block not run yet."""
        while self._next < len(self.blocks):
            self._run(self.blocks[self._next])
            self._next += 1

    def _run(self, block: Block) -> None:
        code = self.rename(block.code)
        if block.kind == "file":
            (self.workdir / block.arg).write_text(code)
        elif block.lang == "python":
            cwd = os.getcwd()
            os.chdir(self.workdir)
            try:
                exec(compile(code, f"{block}", "exec"), self.namespace)
            finally:
                os.chdir(cwd)
        elif block.lang in ("sh", "bash", "console"):
            if block.arg == "restart":
                self.stop_background()
            if block.arg in ("background", "restart"):
                log = (self.workdir / f"background-{len(self.background)}.log").open("wb")
                proc = subprocess.Popen(
                    ["bash", "-c", f"exec {code.strip()}"],
                    cwd=self.workdir,
                    env=self.env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
                self.background.append((proc, log))
                return
            out = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", code],
                cwd=self.workdir,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert out.returncode == 0, (
                f"{block} exited {out.returncode}:\n{code}\n{out.stdout}\n{out.stderr}"
            )
            if block.id:
                self.outputs[block.id] = out.stdout
        else:
            raise AssertionError(f"{block}: cannot run a block of language {block.lang!r}")

    def run_shell(self, command: str) -> str:
        """Run a command of the test's own (not from the page) in the page's directory; its stdout."""
        out = subprocess.run(
            ["bash", "-c", command],
            cwd=self.workdir,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        return out.stdout

    def background_log(self) -> str:
        """What the background processes printed so far."""
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.workdir.glob("background-*.log")))

    def stop_background(self) -> None:
        """SIGTERM every background process (a graceful stop) and wait for it."""
        for proc, log in self.background:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            log.close()
        self.background = []
