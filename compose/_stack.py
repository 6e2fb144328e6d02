"""Run kafka-taskq's services (PostgreSQL, Kafka, Apicurio Registry) as local processes, without Docker.

    compose/stack up [--brokers N]      start what is not running, wait until all answer, print exports
    compose/stack down                  stop what this stack started (pid files in the state dir)
    compose/stack status                one line per service; exit 0 if all run, 3 otherwise
    compose/stack start|stop|restart SERVICE   one of: postgres, kafka, registry, and kafka-1..kafka-N
    compose/stack kill SERVICE          SIGKILL it (a hard crash, for failure tests); `start` brings it back
    compose/stack env                   print the export lines without starting anything

`--brokers N` (1 to 5, default 1) runs Kafka as an N-node KRaft cluster, each node a broker and a controller,
named kafka-1..kafka-N; `kafka` names them all. Node k takes client port TASKQ_STACK_KAFKA_PORT+k-1,
controller port C+k-1, where C is TASKQ_STACK_KAFKA_CONTROLLER_PORT, or TASKQ_STACK_KAFKA_PORT+N when that
falls among the client ports, and SASL_SSL port TASKQ_STACK_KAFKA_SASL_PORT+k-1 (the defaults: clients
19092-19094, controllers 19095-19097, SASL_SSL 19102-19104). Topics default to replication factor min(N, 3)
and min.insync.replicas 2 (1 below three nodes). The state dir remembers N, so later commands follow it;
another N needs another state dir (or Kafka's data removed).

`eval "$(compose/stack up)"` sets TASKQ_BOOTSTRAP_SERVERS, TASKQ_SCHEMA_REGISTRY_URL, TASKQ_DATABASE_URL,
and the facts of Kafka's SASL_SSL listener (SCRAM-SHA-512 over TLS): TASKQ_STACK_SASL_BOOTSTRAP (every
node's), TASKQ_STACK_SASL_CA (the CA file), TASKQ_STACK_SASL_USERNAME, TASKQ_STACK_SASL_PASSWORD. Only export
lines go to stdout; progress and errors go to stderr.

Environment:
    TASKQ_STACK_DIR            state (data, logs, pid files); default <repo>/.stack
    XDG_CACHE_HOME             jars are cached in ${XDG_CACHE_HOME:-~/.cache}/kafka-taskq
    TASKQ_STACK_JAVA           Java 17+ for Kafka (default: `java` on PATH)
    TASKQ_STACK_JAVA21         Java 21+ for Apicurio (default: searched in /usr/lib/jvm, JAVA_HOME, PATH)
    TASKQ_STACK_KAFKA_PORT (19092), TASKQ_STACK_KAFKA_CONTROLLER_PORT (19093),
    TASKQ_STACK_REGISTRY_PORT (18081), TASKQ_STACK_REGISTRY_MANAGEMENT_PORT (18082),
    TASKQ_STACK_POSTGRES_PORT (15432), TASKQ_STACK_KAFKA_SASL_PORT (the Kafka port + 10)
    TASKQ_STACK_TIMEOUT        seconds to wait for each service to answer (default 180)

Standard library only: this runs before any virtualenv exists.
"""

# The executable compose/stack imports this module and calls `main`. Nothing here reads the environment at
# import: `main` reads it once, into a `StackConfig`, and hands that to the services.

from __future__ import annotations

import base64
import contextlib
import glob
import hashlib
import json
import os
import pwd
import re
import secrets
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tarfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import NamedTuple, NoReturn

APICURIO_VERSION = "3.3.3"
APICURIO_GAV = f"io.apicurio:apicurio-registry-app:{APICURIO_VERSION}:tar.gz:all"
PG_SUPERUSER = "postgres"
PG_DATABASES = ("taskq", "registry")
MAX_BROKERS = 5
DEPENDS = {"registry": ("postgres",)}
DEFAULT_TIMEOUT = "180"  # seconds, as TASKQ_STACK_TIMEOUT would spell it
SASL_MECHANISM = "SCRAM-SHA-512"
SASL_USERNAME = "taskq"


class StackError(Exception):
    pass


# ------------------------------------------------------------------------------------------- config


def _port(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise StackError(f"{name}={raw!r} is not a port number") from None


def _home(environ: Mapping[str, str]) -> Path:
    """`Path.home()`, but from `environ`: $HOME, else the password database."""
    if "HOME" in environ:
        return Path(environ["HOME"])
    return Path(pwd.getpwuid(os.getuid()).pw_dir)


@dataclass(frozen=True)
class StackConfig:
    """Everything the stack takes from its environment, read once (`from_env`, called by `main`)."""

    repo: Path  # the checkout: compose/ holds the pom and log4j2.yaml
    state: Path  # TASKQ_STACK_DIR (default <repo>/.stack), resolved: data, logs, pid files
    cache: Path  # ${XDG_CACHE_HOME:-~/.cache}/kafka-taskq: the jars
    m2: Path  # TASKQ_STACK_M2 (default ~/.m2/repository): where Maven puts the Apicurio tarball
    timeout: float  # TASKQ_STACK_TIMEOUT: seconds to wait for each service to answer
    postgres_port: int  # TASKQ_STACK_POSTGRES_PORT
    kafka_port: int  # TASKQ_STACK_KAFKA_PORT
    kafka_controller_port: int  # TASKQ_STACK_KAFKA_CONTROLLER_PORT
    kafka_sasl_port: int  # TASKQ_STACK_KAFKA_SASL_PORT: the SASL_SSL listener
    registry_port: int  # TASKQ_STACK_REGISTRY_PORT
    registry_management_port: int  # TASKQ_STACK_REGISTRY_MANAGEMENT_PORT
    java: str | None  # TASKQ_STACK_JAVA: Java 17+ for Kafka
    java21: str | None  # TASKQ_STACK_JAVA21: Java 21+ for Apicurio
    java_home: str | None  # JAVA_HOME: one more place to look for a Java
    # The whole environment, for the children started with an explicit one (PATH is searched in it too).
    environ: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str], repo: Path | None = None) -> StackConfig:
        repo = repo if repo is not None else Path(__file__).resolve().parent.parent
        raw_timeout = environ.get("TASKQ_STACK_TIMEOUT", DEFAULT_TIMEOUT)
        try:
            timeout = float(raw_timeout)
        except ValueError:
            raise StackError(f"TASKQ_STACK_TIMEOUT={raw_timeout!r} is not a number of seconds") from None
        m2 = environ.get("TASKQ_STACK_M2")
        kafka_port = _port(environ, "TASKQ_STACK_KAFKA_PORT", 19092)
        return cls(
            repo=repo,
            state=Path(environ.get("TASKQ_STACK_DIR") or repo / ".stack").resolve(),
            cache=Path(environ.get("XDG_CACHE_HOME") or _home(environ) / ".cache") / "kafka-taskq",
            m2=Path(m2) if m2 is not None else _home(environ) / ".m2" / "repository",
            timeout=timeout,
            postgres_port=_port(environ, "TASKQ_STACK_POSTGRES_PORT", 15432),
            kafka_port=kafka_port,
            kafka_controller_port=_port(environ, "TASKQ_STACK_KAFKA_CONTROLLER_PORT", 19093),
            # + 10: clear of the client and controller ports of a cluster of up to five nodes
            # (kafka_port + 0..9), so a node k can take the SASL_SSL port kafka_sasl_port + k - 1.
            kafka_sasl_port=_port(environ, "TASKQ_STACK_KAFKA_SASL_PORT", kafka_port + 10),
            registry_port=_port(environ, "TASKQ_STACK_REGISTRY_PORT", 18081),
            registry_management_port=_port(environ, "TASKQ_STACK_REGISTRY_MANAGEMENT_PORT", 18082),
            java=environ.get("TASKQ_STACK_JAVA") or None,
            java21=environ.get("TASKQ_STACK_JAVA21") or None,
            java_home=environ.get("JAVA_HOME") or None,
            environ=MappingProxyType(dict(environ)),
        )

    @property
    def compose(self) -> Path:
        return self.repo / "compose"

    @property
    def logs(self) -> Path:
        return self.state / "logs"

    @property
    def run(self) -> Path:
        return self.state / "run"

    @property
    def path(self) -> str | None:
        """$PATH, where tools are looked up."""
        return self.environ.get("PATH")


# ------------------------------------------------------------------------------------------ helpers


def log(msg: str) -> None:
    print(f"stack: {msg}", file=sys.stderr, flush=True)


def die(msg: str, code: int = 1) -> NoReturn:
    print(f"stack: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def tail(path: Path, lines: int = 30) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"(cannot read {path}: {e})"
    return "\n".join(data.splitlines()[-lines:])


# --------------------------------------------------------------------------------------------- probes


def tcp_open(port: int, host: str = "127.0.0.1", timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def port_free(port: int) -> bool:
    """True when nothing listens on 127.0.0.1:port (or the wildcard address)."""
    if tcp_open(port, timeout=0.5):
        return False
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def kafka_api_versions(port: int, timeout: float = 3.0) -> bool:
    """Send a Kafka ApiVersions v0 request; True if the broker answers without error."""
    client_id = b"taskq-stack"
    body = struct.pack(">hhih", 18, 0, 1, len(client_id)) + client_id
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(struct.pack(">i", len(body)) + body)
            head = _recv_exact(s, 4)
            (size,) = struct.unpack(">i", head)
            resp = _recv_exact(s, min(size, 10))
            corr, err = struct.unpack(">ih", resp[:6])
            return int(corr) == 1 and int(err) == 0
    except (OSError, struct.error):
        return False


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise OSError("connection closed")
        buf += chunk
    return buf


def http(method: str, url: str, body: bytes | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method)
    if body is not None:
        req.add_header("Content-Type", "application/vnd.schemaregistry.v1+json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, urllib.error.URLError):
        return 0, b""


# ------------------------------------------------------------------------------------ process records


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is not alive for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def which(name: str, path: str | None) -> str | None:
    return shutil.which(name, path=path)


class RunAs(NamedTuple):
    """The ids a child runs under; None: ours."""

    user: int | None = None
    group: int | None = None
    extra_groups: list[int] | None = None


AS_OURSELVES = RunAs()


class Service(ABC):
    name = ""
    port_env = ""  # the variable that sets `port`, named in errors

    def __init__(self, cfg: StackConfig, port: int) -> None:
        self.cfg = cfg
        self.port = port
        self.record_path = cfg.run / f"{self.name}.json"
        self.log_path = cfg.logs / f"{self.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    # record: {"pid": int, "port": int, ...}, written when started
    def record(self) -> dict[str, object] | None:
        try:
            data = json.loads(self.record_path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def _recorded_int(self, key: str) -> int | None:
        rec = self.record()
        value = rec.get(key) if rec else None
        if not value or not isinstance(value, int | float | str):
            return None
        try:
            return int(value)
        except ValueError:
            return None

    def write_record(self, **extra: object) -> None:
        self.cfg.run.mkdir(parents=True, exist_ok=True)
        data = {"pid": self.pid(), "port": self.port, "started": time.time(), **extra}
        tmp = self.record_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(self.record_path)
        (self.cfg.run / f"{self.name}.pid").write_text(f"{data['pid']}\n")

    def clear_record(self) -> None:
        for p in (self.record_path, self.cfg.run / f"{self.name}.pid"):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()

    def pid(self) -> int | None:
        if self.proc is not None:
            return self.proc.pid
        return self._recorded_int("pid")

    def recorded_port(self) -> int:
        return self._recorded_int("port") or self.port

    def ours_alive(self) -> int | None:
        """The pid of our process if it is alive (and really ours: its command line names the state dir)."""
        pid = self.pid()
        if pid and pid_alive(pid) and str(self.cfg.state) in cmdline(pid):
            return pid
        return None

    def ports(self) -> list[int]:
        return [self.port]

    @abstractmethod
    def answering(self) -> bool:
        """Whether the service answers its clients."""

    def prepare(self) -> None:  # noqa: B027 - an optional step: nothing by default
        """Fetch/extract/initialise; may run in a thread before the service is started."""

    @abstractmethod
    def launch(self) -> None:
        """Start the service's process."""

    def after_ready(self) -> None:  # noqa: B027 - an optional step: nothing by default
        """Set the service up once it answers (databases, configuration)."""

    def stop(self) -> None:
        pid = self.ours_alive()
        if pid is None:
            if self.record():
                log(f"{self.name}: not running (stale pid file removed)")
            self.clear_record()
            return
        log(f"{self.name}: stopping pid {pid}")
        terminate(pid, self.name)
        self.clear_record()

    def kill(self) -> None:
        """SIGKILL the service (and what it started): a crash, with no chance to shut down cleanly."""
        pid = self.ours_alive()
        if pid is None:
            log(f"{self.name}: not running")
            self.clear_record()
            return
        log(f"{self.name}: killing pid {pid} (SIGKILL)")
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(pid) == pid:  # we started it as a session leader: its children die with it
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        for _ in range(100):
            if not pid_alive(pid):
                break
            time.sleep(0.1)
        self.clear_record()

    # helpers
    def spawn(self, argv: list[str], env: dict[str, str] | None = None, ids: RunAs = AS_OURSELVES) -> None:
        self.cfg.logs.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out, open(os.devnull, "rb") as devnull:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            out.write(f"\n===== {stamp} compose/stack starting {self.name}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                argv,
                stdin=devnull,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
                env=env,
                cwd=str(self.cfg.state),
                user=ids.user,
                group=ids.group,
                extra_groups=ids.extra_groups,
            )
        self.write_record()

    def exited(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is not None
        pid = self.pid()
        return not (pid and pid_alive(pid))

    def fail(self, why: str, logfile: Path | None = None) -> StackError:
        logfile = logfile or self.log_path
        return StackError(
            f"{self.name} {why}\n----- last lines of {logfile} -----\n{tail(logfile)}\n"
            f"----- (full log: {logfile})"
        )


def terminate(pid: int, name: str, grace: float = 30.0) -> None:
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        return
    target_group = pgid == pid  # we started it as a session leader

    def sig(s: signal.Signals) -> None:
        if target_group:
            os.killpg(pgid, s)
        else:
            os.kill(pid, s)

    with contextlib.suppress(ProcessLookupError):
        sig(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            break
        time.sleep(0.2)
    else:
        log(f"{name}: pid {pid} still running after {grace:.0f}s, sending SIGKILL")
        with contextlib.suppress(ProcessLookupError):
            sig(signal.SIGKILL)
        for _ in range(50):
            if not pid_alive(pid):
                break
            time.sleep(0.1)
    if target_group:  # leftovers in the group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


# -------------------------------------------------------------------------------------------- java


def java_major(java: str) -> int | None:
    try:
        out = subprocess.run(
            [java, "-XshowSettings:properties", "-version"],
            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
        ).stderr
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"java\.specification\.version = (\d+)", out) or re.search(r'version "(\d+)', out)
    return int(m.group(1)) if m else None


def find_java(
    minimum: int, env_var: str, explicit: str | None, cfg: StackConfig, prefer_path: bool
) -> tuple[str, int]:
    """A Java `minimum`+: `explicit` (the value of `env_var`) if set, else the best one found."""
    found = _find_java(minimum, env_var, explicit, cfg, prefer_path)
    if found is None:
        raise StackError(
            f"no Java {minimum}+ runtime found (looked at ${env_var}, /usr/lib/jvm/*/bin/java, $JAVA_HOME, "
            f"PATH); install one (e.g. `apt-get install openjdk-{max(minimum, 17)}-jre-headless` or Temurin "
            f"{minimum}+) or point {env_var} at its bin/java"
        )
    return found


def _find_java(
    minimum: int, env_var: str, explicit: str | None, cfg: StackConfig, prefer_path: bool
) -> tuple[str, int] | None:
    if explicit:
        v = java_major(explicit)
        if v is None:
            raise StackError(f"{env_var}={explicit} does not run as java")
        if v < minimum:
            raise StackError(f"{env_var}={explicit} is Java {v}; Java {minimum}+ is needed")
        return explicit, v
    candidates: list[str] = []
    on_path = which("java", cfg.path)
    if prefer_path and on_path:
        candidates.append(on_path)
    candidates += sorted(glob.glob("/usr/lib/jvm/*/bin/java"))
    if cfg.java_home:
        candidates.append(os.path.join(cfg.java_home, "bin", "java"))
    if on_path and not prefer_path:
        candidates.append(on_path)
    seen: set[str] = set()
    best: tuple[str, int] | None = None
    for c in candidates:
        real = os.path.realpath(c)
        if real in seen or not os.access(real, os.X_OK):
            continue
        seen.add(real)
        v = java_major(c)
        if v is None or v < minimum:
            continue
        if prefer_path:
            return c, v
        if best is None or v < best[1]:  # the oldest that qualifies: the most conservative choice
            best = (c, v)
    return best


def _last_lines(text: str, n: int = 30) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def need_tool(name: str, hint: str, cfg: StackConfig) -> str:
    path = which(name, cfg.path)
    if not path:
        raise StackError(f"`{name}` not found on PATH; {hint}")
    return path


# ---------------------------------------------------------------------------------------- postgres


class Postgres(Service):
    name = "postgres"
    port_env = "TASKQ_STACK_POSTGRES_PORT"

    def __init__(self, cfg: StackConfig) -> None:
        super().__init__(cfg, cfg.postgres_port)
        self.base = cfg.state / "postgres"
        self.data = self.base / "data"
        self.user: pwd.struct_passwd | None = None

    def run_as(self) -> pwd.struct_passwd | None:
        """The OS user the cluster runs as: ourselves, or (as root, which initdb refuses) a system user."""
        if os.geteuid() != 0:
            return None
        if self.user is None:
            for name in ("postgres", "taskq-pg"):
                with contextlib.suppress(KeyError):
                    self.user = pwd.getpwnam(name)
                    break
            if self.user is None:
                log("creating system user taskq-pg to run PostgreSQL (initdb refuses to run as root)")
                subprocess.run(
                    ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "taskq-pg"],
                    check=True, stdin=subprocess.DEVNULL, stdout=sys.stderr,
                )
                self.user = pwd.getpwnam("taskq-pg")
        return self.user

    def _ids(self) -> RunAs:
        u = self.run_as()
        if u is None:
            return AS_OURSELVES
        return RunAs(user=u.pw_uid, group=u.pw_gid, extra_groups=[])

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in self.cfg.environ.items() if not k.startswith("PG")}
        u = self.run_as()
        if u is not None:
            env.update(HOME=str(self.base), USER=u.pw_name, LOGNAME=u.pw_name)
        env["LC_ALL"] = "C"
        return env

    def bin(self, name: str) -> str:
        hint = "install PostgreSQL 15+ server binaries (Debian: `apt-get install postgresql-15`)"
        p = which(name, self.cfg.path)
        if p:
            return p
        found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
        if found:
            return found[-1]
        raise StackError(f"`{name}` not found on PATH or in /usr/lib/postgresql/*/bin; {hint}")

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    def pid(self) -> int | None:
        if self.proc is not None:
            return self.proc.pid
        return self.postmaster_pid() or super().pid()

    def answering(self) -> bool:
        port = self.recorded_port() if self.proc is None else self.port
        if not tcp_open(port):
            return False
        try:
            r = subprocess.run(
                [self.bin("pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(port),
                 "-U", PG_SUPERUSER, "-d", "postgres"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10,
            )
        except (OSError, subprocess.SubprocessError):
            return False
        return r.returncode == 0

    def prepare(self) -> None:
        self.bin("postgres")
        self.bin("pg_ctl")
        self.bin("pg_isready")
        self.bin("psql")
        initdb = self.bin("initdb")
        self.base.mkdir(parents=True, exist_ok=True)
        u = self.run_as()
        if u is not None:
            os.chown(self.base, u.pw_uid, u.pw_gid)
            # the cluster user must be able to reach the data dir through the state dir
            for parent in [self.cfg.state, *self.cfg.state.parents]:
                mode = parent.stat().st_mode
                if not mode & 0o001:
                    log(f"warning: {parent} is not searchable by {u.pw_name}; PostgreSQL may fail to start")
                    break
        if (self.data / "PG_VERSION").exists():
            if u is not None:
                for root, dirs, files in os.walk(self.base):
                    for n in [root, *(os.path.join(root, name) for name in (*dirs, *files))]:
                        with contextlib.suppress(FileNotFoundError):
                            if os.lstat(n).st_uid != u.pw_uid:
                                os.lchown(n, u.pw_uid, u.pw_gid)
            return
        log(f"postgres: initdb {self.data}")
        if self.data.exists():
            shutil.rmtree(self.data)  # a half-made cluster from an interrupted initdb
        ids = self._ids()
        r = subprocess.run(
            [initdb, "-D", str(self.data), "-U", PG_SUPERUSER, "--auth=trust", "-E", "UTF8", "--no-locale",
             "--no-instructions"],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, env=self._env(), cwd=str(self.base),
            user=ids.user, group=ids.group, extra_groups=ids.extra_groups,
        )
        if r.returncode != 0:
            raise StackError(f"postgres: initdb failed:\n{r.stdout}\n{r.stderr}")
        with (self.data / "postgresql.conf").open("a") as f:
            f.write(
                "\n# compose/stack: a small, loopback-only development server\n"
                "max_connections = 200\n"
                "shared_buffers = 32MB\n"
                "work_mem = 4MB\n"
                "maintenance_work_mem = 32MB\n"
                "wal_buffers = 1MB\n"
                "max_wal_size = 256MB\n"
                "dynamic_shared_memory_type = posix\n"
                "logging_collector = off\n"
                "log_min_messages = warning\n"
                "log_line_prefix = '%m [%p] %q%u@%d '\n"
                "timezone = 'UTC'\n"
            )

    def launch(self) -> None:
        # Stale postmaster.pid from a killed server would make postgres refuse to start.
        pmpid = self.postmaster_pid()
        if pmpid and not pid_alive(pmpid):
            with contextlib.suppress(FileNotFoundError):
                (self.data / "postmaster.pid").unlink()
        self.spawn(
            [self.bin("postgres"), "-D", str(self.data), "-p", str(self.port),
             "-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories=",
             # Statement counts for `taskq bench` (statements per task), as production servers have them.
             "-c", "shared_preload_libraries=pg_stat_statements"],
            env=self._env(), ids=self._ids(),
        )

    def psql(self, sql: str, db: str = "postgres") -> str:
        r = subprocess.run(
            [self.bin("psql"), "-X", "-q", "-t", "-A", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1",
             "-p", str(self.port), "-U", PG_SUPERUSER, "-d", db, "-c", sql],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, env=self._env(),
        )
        if r.returncode != 0:
            raise StackError(f"postgres: psql failed ({sql}): {r.stderr.strip()}")
        return r.stdout.strip()

    def after_ready(self) -> None:
        self.port = self.recorded_port() if self.proc is None else self.port
        for db in PG_DATABASES:
            if not self.psql(f"SELECT 1 FROM pg_database WHERE datname = '{db}'"):
                log(f"postgres: creating database {db}")
                self.psql(f'CREATE DATABASE "{db}"')
        # Loaded at start (a server started before it was added to the start options is not, until restarted).
        if "pg_stat_statements" in self.psql("SHOW shared_preload_libraries"):
            self.psql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements", db="taskq")

    def stop(self) -> None:
        pid = self.ours_alive()
        if pid is None:
            self.clear_record()
            return
        log(f"postgres: stopping pid {pid} (pg_ctl stop -m fast)")
        ids = self._ids()
        r = subprocess.run(
            [self.bin("pg_ctl"), "stop", "-D", str(self.data), "-m", "fast", "-w", "-t", "60"],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, env=self._env(), cwd=str(self.base),
            user=ids.user, group=ids.group, extra_groups=ids.extra_groups,
        )
        if r.returncode != 0 or pid_alive(pid):
            log(f"postgres: pg_ctl stop failed ({r.stderr.strip()}); signalling pid {pid}")
            terminate(pid, self.name)
        self.clear_record()


# ------------------------------------------------------------------------------------------- kafka

# Our own openssl configuration, so the system's openssl.cnf (which differs between distributions and
# OpenSSL versions) adds nothing to the certificates.
_OPENSSL_CNF = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = taskq-stack
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[broker]
basicConstraints = CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1,DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""


def new_cluster_id() -> str:
    """A random KRaft cluster id, as StorageTool's random-uuid makes it (made here: it saves a JVM start).

    A base64url UUID, never one that starts with "-": as in Kafka's own Uuid.randomUuid, a command line would
    take such an id for an option.
    """
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def make_tls(openssl: str, directory: Path) -> None:
    """A CA (`ca.pem`) and a broker key and certificate for 127.0.0.1/localhost signed by it, as one PEM
    keystore (`broker.pem`: the PKCS#8 key, then the chain), made once into `directory`; the CA's key is
    not kept."""
    if (directory / "broker.pem").exists():
        return
    tmp = directory.parent / f"{directory.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "openssl.cnf").write_text(_OPENSSL_CNF)
    days = "3650"
    steps = [
        ["genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", "ca.key"],
        ["req", "-new", "-x509", "-config", "openssl.cnf", "-extensions", "ca", "-key", "ca.key",
         "-subj", "/CN=taskq-stack CA", "-days", days, "-out", "ca.pem"],
        ["genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", "broker.key"],
        ["req", "-new", "-config", "openssl.cnf", "-key", "broker.key", "-subj", "/CN=localhost",
         "-out", "broker.csr"],
        ["x509", "-req", "-in", "broker.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
         "-set_serial", str(secrets.randbits(63)), "-days", days, "-extfile", "openssl.cnf",
         "-extensions", "broker", "-out", "broker.crt"],
    ]
    try:
        for step in steps:
            r = subprocess.run(
                [openssl, *step], cwd=tmp, stdin=subprocess.DEVNULL, capture_output=True, text=True
            )
            if r.returncode != 0:
                raise StackError(
                    f"kafka: `openssl {step[0]}` failed making the SASL_SSL listener's certificates "
                    f"(exit {r.returncode}):\n{_last_lines(r.stdout + r.stderr)}"
                )
        # Both versions of genpkey write PKCS#8 ("BEGIN PRIVATE KEY"), the form Kafka's PEM keystore reads.
        keystore = "".join((tmp / name).read_text() for name in ("broker.key", "broker.crt", "ca.pem"))
        (tmp / "broker.pem").touch(mode=0o600)
        (tmp / "broker.pem").write_text(keystore)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # Only the CA certificate and the keystore stay: without its key the CA can sign nothing more.
    for name in ("ca.key", "broker.key", "broker.csr", "broker.crt", "openssl.cnf"):
        (tmp / name).unlink()
    shutil.rmtree(directory, ignore_errors=True)
    tmp.replace(directory)


class KafkaNode(NamedTuple):
    """One KRaft node of the stack's Kafka: its id, its client, controller and SASL_SSL ports."""

    id: int
    port: int
    controller_port: int
    sasl_port: int


def kafka_nodes(cfg: StackConfig, brokers: int) -> list[KafkaNode]:
    """The nodes of a `brokers`-node Kafka, on consecutive ports (see the module docstring)."""
    controllers = cfg.kafka_controller_port
    if cfg.kafka_port <= controllers < cfg.kafka_port + brokers:
        controllers = cfg.kafka_port + brokers
    return [
        KafkaNode(k, cfg.kafka_port + k - 1, controllers + k - 1, cfg.kafka_sasl_port + k - 1)
        for k in range(1, brokers + 1)
    ]


class Kafka(Service):
    name = "kafka"
    port_env = "TASKQ_STACK_KAFKA_PORT"
    started_marker = "Kafka Server started"
    # The nodes prepare in threads: one of them fetches the jars, and the first to need them makes what the
    # cluster shares (its id, TLS material and SCRAM password); the others read it.
    _shared_lock = threading.Lock()

    def __init__(self, cfg: StackConfig, node: KafkaNode | None = None, nodes: int = 1) -> None:
        """Node `node` of a `nodes`-node cluster; by default the one node of a one-broker stack."""
        node = node or KafkaNode(1, cfg.kafka_port, cfg.kafka_controller_port, cfg.kafka_sasl_port)
        # One broker keeps the names it always had; a cluster's nodes are kafka-1..kafka-N.
        self.name = "kafka" if nodes == 1 else f"kafka-{node.id}"
        super().__init__(cfg, node.port)
        self.node = node
        self.voters = kafka_nodes(cfg, nodes) if nodes > 1 else [node]
        self.controller_port = node.controller_port
        self.base = cfg.state / self.name
        self.data = self.base / "data"
        self.props = self.base / "server.properties"
        self.logs_dir = cfg.logs / self.name
        self.server_log = self.logs_dir / "server.log"
        self.log_path = cfg.logs / f"{self.name}.out"
        self.pom = cfg.compose / "kafka-pom.xml"
        m = re.search(r"<kafka\.version>([^<]+)</kafka\.version>", self.pom.read_text())
        self.version = m.group(1) if m else "unknown"
        self.libs = cfg.cache / f"kafka-{self.version}" / "libs"
        self.log_offset = 0
        self.java = ""
        self.sasl_port = node.sasl_port
        self.tls = self.shared("tls")  # ca.pem and the brokers' PEM keystore (make_tls), one for all nodes
        # The SCRAM user's name and password, one for the cluster: written when the user exists in the
        # cluster, or, for a new cluster, before its nodes' storage is formatted with it.
        self.credentials = self.shared("sasl-user.json")
        # The Kafka version whose features the cluster's metadata has: written at format, and after the
        # upgrade of a storage an older Kafka formatted (share groups need share.version 1: 4.1 lacks it).
        self.features = self.shared("features-of")
        self.sasl = False  # whether this start opens the SASL_SSL listener (openssl found)

    def shared(self, what: str) -> Path:
        """Where `what`, shared by all nodes, lives: in the one broker's dir, or beside a cluster's nodes."""
        return self.base / what if len(self.voters) == 1 else self.cfg.state / f"kafka-{what}"

    def ports(self) -> list[int]:
        return [self.port, self.controller_port, self.sasl_port]

    def recorded_sasl_port(self) -> int | None:
        """The running node's SASL_SSL port, if it opened that listener."""
        return self._recorded_int("sasl_port")

    def write_record(self, **extra: object) -> None:
        if self.sasl:  # `exports` tells the SASL_SSL listener only to clients of a broker that has one
            extra["sasl_port"] = self.sasl_port
        super().write_record(**extra)

    def sasl_user(self) -> tuple[str, str] | None:
        """The SCRAM user (name, password), once it exists in the cluster."""
        try:
            data = json.loads(self.credentials.read_text())
            return str(data["username"]), str(data["password"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save_sasl_user(self, password: str) -> None:
        """Record the SCRAM user's password (readable by its owner only)."""
        tmp = self.credentials.with_suffix(".tmp")
        tmp.write_text(json.dumps({"username": SASL_USERNAME, "password": password}))
        os.chmod(tmp, 0o600)
        tmp.replace(self.credentials)

    def answering(self) -> bool:
        return kafka_api_versions(self.recorded_port() if self.proc is None else self.port)

    def ensure_libs(self) -> None:
        with self._shared_lock:
            self._ensure_libs()

    def _ensure_libs(self) -> None:
        stamp = self.libs / ".complete"
        # Fetched for this pom: a pom that changed (a jar added) fetches again, even for the same version.
        wanted = f"{self.version} {hashlib.sha256(self.pom.read_bytes()).hexdigest()[:16]}"
        try:
            if stamp.read_text().strip() == wanted:
                return
        except OSError:
            pass
        mvn = need_tool(
            "mvn", "install Maven 3.6+ (Debian: `apt-get install maven`); it fetches the Kafka jars", self.cfg
        )
        log(f"kafka: fetching Kafka {self.version} jars from Maven Central into {self.libs} (first run only)")
        tmp = self.libs.parent / f"libs.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(
            [mvn, "-q", "-B", "-Dstyle.color=never", "-f", str(self.pom), "dependency:copy-dependencies",
             f"-DoutputDirectory={tmp}", "-DincludeScope=runtime"],
            stdin=subprocess.DEVNULL, capture_output=True, text=True,
        )
        if r.returncode != 0 or not list(tmp.glob("kafka_2.13-*.jar")):
            shutil.rmtree(tmp, ignore_errors=True)
            raise StackError(
                f"kafka: `mvn dependency:copy-dependencies` failed (exit {r.returncode}) for {self.pom}:\n"
                f"{_last_lines(r.stdout + r.stderr)}"
            )
        (tmp / ".complete").write_text(f"{wanted}\n")
        shutil.rmtree(self.libs, ignore_errors=True)
        tmp.replace(self.libs)

    def classpath(self) -> str:
        return str(self.libs / "*")

    def write_props(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        p, c = self.port, self.controller_port
        voters = ",".join(f"{v.id}@127.0.0.1:{v.controller_port}" for v in self.voters)
        # Three copies of every partition, and acks=all needs two of them: one node can fail (or be killed)
        # and producers, transactions and offset commits carry on. Fewer nodes: as many copies as nodes.
        rf = min(len(self.voters), 3)
        isr = max(1, min(2, rf - 1))
        # A cluster fences a node that stops answering after 6 s (Kafka's default is 9 s): leadership of its
        # partitions moves and it leaves their in-sync replicas.
        fencing = "broker.session.timeout.ms=6000\nbroker.heartbeat.interval.ms=1000\n" if rf > 1 else ""
        advertised = f"PLAINTEXT://127.0.0.1:{p}"
        listeners = f"{advertised},CONTROLLER://127.0.0.1:{c}"
        protocols, sasl = "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT", ""
        if self.sasl:
            # SCRAM-SHA-512 over TLS for clients that choose it; brokers and controllers stay on PLAINTEXT.
            listeners += f",SASL_SSL://127.0.0.1:{self.sasl_port}"
            advertised += f",SASL_SSL://127.0.0.1:{self.sasl_port}"
            protocols += ",SASL_SSL:SASL_SSL"
            sasl = (
                f"listener.name.sasl_ssl.sasl.enabled.mechanisms={SASL_MECHANISM}\n"
                f"listener.name.sasl_ssl.{SASL_MECHANISM.lower()}.sasl.jaas.config="
                "org.apache.kafka.common.security.scram.ScramLoginModule required;\n"
                "listener.name.sasl_ssl.ssl.keystore.type=PEM\n"
                f"listener.name.sasl_ssl.ssl.keystore.location={self.tls / 'broker.pem'}\n"
            )
        self.props.write_text(
            "# Written by compose/stack on every start; edit compose/stack, not this file.\n"
            "process.roles=broker,controller\n"
            f"node.id={self.node.id}\n"
            f"controller.quorum.voters={voters}\n"
            f"listeners={listeners}\n"
            f"advertised.listeners={advertised}\n"
            "controller.listener.names=CONTROLLER\n"
            "inter.broker.listener.name=PLAINTEXT\n"
            f"listener.security.protocol.map={protocols}\n"
            f"{sasl}"
            f"log.dirs={self.data}\n"
            "auto.create.topics.enable=false\n"
            "num.partitions=1\n"
            f"default.replication.factor={rf}\n"
            f"min.insync.replicas={isr}\n"
            f"offsets.topic.replication.factor={rf}\n"
            "offsets.topic.num.partitions=10\n"
            f"transaction.state.log.replication.factor={rf}\n"
            f"transaction.state.log.min.isr={isr}\n"
            "transaction.state.log.num.partitions=10\n"
            f"share.coordinator.state.topic.replication.factor={rf}\n"
            f"share.coordinator.state.topic.min.isr={isr}\n"
            "group.initial.rebalance.delay.ms=0\n"
            # KIP-848 groups: the broker owns session and heartbeat. A dead worker's partitions move after
            # 10 s (Kafka's default is 45 s), and assignments reach members within a second.
            "group.consumer.session.timeout.ms=10000\n"
            "group.consumer.min.session.timeout.ms=6000\n"
            "group.consumer.heartbeat.interval.ms=1000\n"
            "group.consumer.min.heartbeat.interval.ms=500\n"
            # Kafka 4.3 computes a group's assignments at most once a second (KIP-1263's batching, for groups
            # of thousands): a worker joining a group of a few waited for that as well. Here: at once.
            "group.consumer.assignment.interval.ms=0\n"
            # Share groups: a group may set its record lock as short as 1 s (Kafka's floor is 15 s), so the
            # tests of an expired lock wait 1 s for it, not 15.
            "group.share.min.record.lock.duration.ms=1000\n"
            f"{fencing}"
            "num.network.threads=2\n"
            "num.io.threads=4\n"
            "num.recovery.threads.per.data.dir=1\n"
            "log.retention.hours=24\n"
            "log.segment.bytes=67108864\n"
            "delete.topic.enable=true\n"
        )

    def prepare(self) -> None:
        self.java, _ = find_java(17, "TASKQ_STACK_JAVA", self.cfg.java, self.cfg, prefer_path=True)
        self.ensure_libs()
        openssl = which("openssl", self.cfg.path)
        self.sasl = openssl is not None
        if openssl is None:
            log(f"{self.name}: `openssl` not found on PATH; starting without the SASL_SSL listener")
        else:
            with self._shared_lock:  # made once, by the first node to get here
                make_tls(openssl, self.tls)
        self.write_props()
        if (self.data / "meta.properties").exists():
            return  # a SCRAM user missing from an older storage is added once the broker answers
        # A cluster's nodes share one id and one SCRAM user: the first node to get here makes them, the others
        # read them.
        cid_file = self.shared("cluster.id")
        # The other nodes' storage: formatted already when this node joins an existing cluster.
        others = [self.cfg.state / f"kafka-{v.id}" / "data" for v in self.voters if v != self.node]
        with self._shared_lock:
            if cid_file.exists():
                cluster_id = cid_file.read_text().strip()
            else:
                cluster_id = new_cluster_id()
                cid_file.write_text(cluster_id + "\n")
            user = self.sasl_user()
            if user is None and not any((o / "meta.properties").exists() for o in others):
                # A new cluster: every node's storage is formatted with this one password, so their bootstrap
                # metadata agree. A node joining older storage takes the user from the cluster's metadata,
                # and a user missing there is added by after_ready.
                self.save_sasl_user(secrets.token_urlsafe(18))
                user = self.sasl_user()
        log(f"{self.name}: formatting storage {self.data} (cluster id {cluster_id})")
        self.data.mkdir(parents=True, exist_ok=True)
        # The SCRAM user is created with the storage: no extra JVM start, nothing to wait for.
        scram = ["--add-scram", f"{SASL_MECHANISM}=[name={user[0]},password={user[1]}]"] if user else []
        # "--cluster-id=": an older state directory's id may start with "-", which would read as an option.
        args = ["format", f"--cluster-id={cluster_id}", "-c", str(self.props), *scram]
        r = self.tool("kafka.tools.StorageTool", *args)
        if r.returncode != 0 or not (self.data / "meta.properties").exists():
            raise StackError(f"{self.name}: storage format failed:\n{r.stdout}\n{r.stderr}")
        if not others or not any((o / "meta.properties").exists() for o in others):
            self.features.write_text(f"{self.version}\n")  # a new cluster: formatted with this one's features

    def tool(self, main_class: str, *args: str) -> subprocess.CompletedProcess[str]:
        """Run one of Kafka's command-line tools (a JVM) to completion."""
        return subprocess.run(
            [self.java, "-Xmx256m", "-XX:TieredStopAtLevel=1",  # a short-lived tool: the quick compiler only
             f"-Dlog4j2.configurationFile={self.cfg.compose / 'log4j2.yaml'}",
             f"-Dkafka.logs.dir={self.logs_dir}", "-cp", self.classpath(), main_class, *args],
            stdin=subprocess.DEVNULL, capture_output=True, text=True,
        )

    def after_ready(self) -> None:
        self.upgrade_features()
        # A storage formatted before the SASL_SSL listener existed has no SCRAM user: add it once. The nodes'
        # after_ready run one after another, and the first to add the user records it for the others.
        if self.recorded_sasl_port() is None or self.sasl_user() is not None:
            return
        if not self.java:
            self.java, _ = find_java(17, "TASKQ_STACK_JAVA", self.cfg.java, self.cfg, prefer_path=True)
        log(f"{self.name}: adding the SCRAM user {SASL_USERNAME} to the existing storage")
        password = secrets.token_urlsafe(18)
        r = self.tool(
            "kafka.admin.ConfigCommand", "--bootstrap-server", f"127.0.0.1:{self.recorded_port()}",
            "--alter", "--entity-type", "users", "--entity-name", SASL_USERNAME,
            "--add-config", f"{SASL_MECHANISM}=[password={password}]",
        )
        if r.returncode != 0:
            raise StackError(
                f"{self.name}: adding the SCRAM user failed (exit {r.returncode}):\n"
                f"{_last_lines(r.stdout + r.stderr)}"
            )
        self.save_sasl_user(password)

    def upgrade_features(self) -> None:
        """Once, for a storage an older Kafka formatted: finalize this version's features (metadata.version,
        share.version...) as `kafka-features.sh upgrade --release-version` does; the first node records it."""
        try:
            if self.features.read_text().strip() == self.version:
                return
        except OSError:
            pass  # formatted before the record existed: by an older Kafka
        release = ".".join(self.version.split(".")[:2])
        if not self.java:
            self.java, _ = find_java(17, "TASKQ_STACK_JAVA", self.cfg.java, self.cfg, prefer_path=True)
        log(f"{self.name}: upgrading the cluster's features to Kafka {release} (storage of an older Kafka)")
        r = self.tool(
            "org.apache.kafka.tools.FeatureCommand",
            "--bootstrap-server", f"127.0.0.1:{self.recorded_port()}",
            "upgrade", "--release-version", release,
        )
        if r.returncode != 0:
            raise StackError(
                f"{self.name}: upgrading the features to {release} failed (exit {r.returncode}):\n"
                f"{_last_lines(r.stdout + r.stderr)}"
            )
        self.features.write_text(f"{self.version}\n")

    def launch(self) -> None:
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.log_offset = self.server_log.stat().st_size
        except FileNotFoundError:
            self.log_offset = 0
        # A cluster's nodes share the machine with everything else: smaller heaps, and the quick compiler
        # only, which about halves the CPU a node burns while it starts (a restart's length, under load).
        jvm = ["-Xms128m", "-Xmx512m"]
        if len(self.voters) > 1:
            jvm = ["-Xms64m", "-Xmx256m", "-XX:TieredStopAtLevel=1"]
        self.spawn(
            [self.java, *jvm, "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20",
             "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true",
             f"-Dtaskq.stack={self.cfg.state}",
             f"-Dkafka.logs.dir={self.logs_dir}",
             f"-Dlog4j2.configurationFile={self.cfg.compose / 'log4j2.yaml'}",
             "-cp", self.classpath(), "kafka.Kafka", str(self.props)],
        )

    def started_logged(self) -> bool:
        try:
            with self.server_log.open("rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(self.log_offset if size >= self.log_offset else 0)
                return self.started_marker.encode() in f.read()
        except OSError:
            return False

    def ready_after_launch(self) -> bool:
        return self.started_logged() and self.answering()


# ---------------------------------------------------------------------------------------- registry


class Registry(Service):
    name = "registry"
    port_env = "TASKQ_STACK_REGISTRY_PORT"

    def __init__(self, cfg: StackConfig, pg: Postgres) -> None:
        super().__init__(cfg, cfg.registry_port)
        self.pg = pg
        self.mgmt_port = cfg.registry_management_port
        self.home = cfg.cache / f"apicurio-registry-{APICURIO_VERSION}"
        self.java = ""

    def ports(self) -> list[int]:
        return [self.port, self.mgmt_port]

    def url(self, port: int | None = None) -> str:
        return f"http://127.0.0.1:{port or self.port}/apis/ccompat/v7"

    def answering(self) -> bool:
        port = self.recorded_port() if self.proc is None else self.port
        status, _ = http("GET", self.url(port) + "/subjects")
        return status == 200

    def ensure_dist(self) -> None:
        if (self.home / ".complete").exists():
            return
        tgz = (self.cfg.m2 / "io/apicurio/apicurio-registry-app" / APICURIO_VERSION
               / f"apicurio-registry-app-{APICURIO_VERSION}-all.tar.gz")
        if not tgz.exists():
            mvn = need_tool(
                "mvn", "install Maven 3.6+ (Debian: `apt-get install maven`); it fetches Apicurio", self.cfg
            )
            log(f"registry: fetching {APICURIO_GAV} from Maven Central (first run only, ~150 MB)")
            r = subprocess.run(
                [mvn, "-q", "-B", "-Dstyle.color=never", "-f", str(self.cfg.compose / "kafka-pom.xml"),
                 "dependency:get", f"-Dartifact={APICURIO_GAV}", "-Dtransitive=false"],
                stdin=subprocess.DEVNULL, capture_output=True, text=True,
            )
            if r.returncode != 0 or not tgz.exists():
                raise StackError(
                    f"registry: `mvn dependency:get -Dartifact={APICURIO_GAV}` failed "
                    f"(exit {r.returncode}):\n"
                    f"{_last_lines(r.stdout + r.stderr)}"
                )
        log(f"registry: extracting {tgz.name} into {self.home}")
        tmp = self.home.parent / f"{self.home.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            with tarfile.open(tgz) as tf:
                if hasattr(tarfile, "data_filter"):  # Python 3.11.4+ / 3.12
                    tf.extractall(tmp, filter="data")
                else:
                    base = os.path.realpath(tmp)
                    for m in tf.getmembers():
                        dest = os.path.realpath(os.path.join(tmp, m.name))
                        if not (dest == base or dest.startswith(base + os.sep)) or m.isdev():
                            raise StackError(
                                f"registry: refusing suspicious archive member {m.name!r} in {tgz}"
                            )
                    tf.extractall(tmp)
            runjars = list(tmp.glob("quarkus-run.jar")) or list(tmp.glob("*/quarkus-run.jar"))
            if not runjars:
                shutil.rmtree(tmp, ignore_errors=True)
                raise StackError(f"registry: {tgz} has no quarkus-run.jar")
            if runjars[0].parent != tmp:  # flatten a top-level directory
                inner = runjars[0].parent
                for child in inner.iterdir():
                    child.rename(tmp / child.name)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        (tmp / ".complete").write_text(f"{APICURIO_VERSION}\n")
        shutil.rmtree(self.home, ignore_errors=True)
        tmp.replace(self.home)

    def prepare(self) -> None:
        self.java, _ = find_java(21, "TASKQ_STACK_JAVA21", self.cfg.java21, self.cfg, prefer_path=False)
        self.ensure_dist()

    def launch(self) -> None:
        env = dict(self.cfg.environ)
        env.update(
            APICURIO_STORAGE_KIND="sql",
            APICURIO_STORAGE_SQL_KIND="postgresql",
            APICURIO_DATASOURCE_URL=f"jdbc:postgresql://127.0.0.1:{self.pg.recorded_port()}/registry",
            APICURIO_DATASOURCE_USERNAME=PG_SUPERUSER,
            APICURIO_DATASOURCE_PASSWORD="postgres",  # ignored: the dev cluster trusts loopback
            APICURIO_REST_DELETION_ARTIFACT_ENABLED="true",
            APICURIO_REST_DELETION_ARTIFACT_VERSION_ENABLED="true",
            APICURIO_REST_DELETION_GROUP_ENABLED="true",
            QUARKUS_HTTP_HOST="127.0.0.1",
            QUARKUS_HTTP_PORT=str(self.port),
            QUARKUS_MANAGEMENT_HOST="127.0.0.1",
            QUARKUS_MANAGEMENT_PORT=str(self.mgmt_port),
            QUARKUS_LOG_CONSOLE_COLOR="false",
            # Its pool keeps 20 connections, all dead after a Postgres restart: each request that took one
            # failed with HTTP 500 until every one had (about 50 s at the workers' rate). Each connection is
            # checked as it is borrowed instead (a dead one is replaced at once).
            QUARKUS_DATASOURCE_POSTGRESQL_JDBC_VALIDATE_ON_BORROW="true",
        )
        self.spawn(
            [self.java, "-Xms64m", "-Xmx384m", "-XX:+UseSerialGC", "-XX:+ExitOnOutOfMemoryError",
             f"-Dtaskq.stack={self.cfg.state}", "-jar", str(self.home / "quarkus-run.jar")],
            env=env,
        )

    def after_ready(self) -> None:
        port = self.recorded_port() if self.proc is None else self.port
        body = json.dumps({"compatibility": "BACKWARD"}).encode()
        # Its first write may take longer than a request's 5 s on a loaded machine (a cold JVM, a new
        # database): not answered (0) or a server error is tried again, for up to a minute.
        deadline = time.monotonic() + 60
        while True:
            status, answer = http("PUT", self.url(port) + "/config", body, timeout=15.0)
            if status == 200 or (status != 0 and status < 500) or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        if status != 200:
            raise StackError(
                f"registry: setting global compatibility BACKWARD failed: HTTP {status} {answer[:300]!r}"
            )


# --------------------------------------------------------------------------------------------- stack


def brokers_of(cfg: StackConfig, requested: int | None) -> int:
    """How many Kafka nodes the stack runs: `requested` (--brokers), else what its state dir last ran."""
    try:
        recorded: int | None = int((cfg.state / "kafka.brokers").read_text())
    except (OSError, ValueError):
        recorded = None
    formatted = sorted(cfg.state.glob("kafka*/data/meta.properties"))
    if recorded is None and formatted:
        recorded = 1  # a state dir from before clusters: its one broker
    if requested is None:
        return recorded or 1
    if formatted and recorded not in (None, requested):
        raise StackError(
            f"{cfg.state} holds a {recorded}-broker Kafka, not {requested}; run `compose/stack down` and "
            f"remove {cfg.state}/kafka* for another cluster size, or use another TASKQ_STACK_DIR"
        )
    return requested


class Stack:
    def __init__(self, cfg: StackConfig, brokers: int = 1) -> None:
        self.cfg = cfg
        self.postgres = Postgres(cfg)
        self.kafkas = [Kafka(cfg, node, brokers) for node in kafka_nodes(cfg, brokers)]
        self.registry = Registry(cfg, self.postgres)
        services: list[Service] = [self.postgres, *self.kafkas, self.registry]  # start order; stop reversed
        self.by_name = {s.name: s for s in services}
        self.names = [s.name for s in services]

    def exports(self) -> list[str]:
        bootstrap = ",".join(f"127.0.0.1:{k.recorded_port()}" for k in self.kafkas)
        return [
            f"export TASKQ_BOOTSTRAP_SERVERS={bootstrap}",
            f"export TASKQ_SCHEMA_REGISTRY_URL={self.registry.url(self.registry.recorded_port())}",
            f"export TASKQ_DATABASE_URL="
            f"postgresql://{PG_SUPERUSER}@127.0.0.1:{self.postgres.recorded_port()}/taskq",
            *self.sasl_exports(),
        ]

    def sasl_exports(self) -> list[str]:
        """The SASL_SSL listener's connection facts, every node's address, when the running Kafka has one."""
        recorded = [k.recorded_sasl_port() for k in self.kafkas]
        user = self.kafkas[0].sasl_user()
        if not any(recorded) or user is None:
            return []
        # Like TASKQ_BOOTSTRAP_SERVERS, a node that is down is listed with the port it starts on.
        bootstrap = ",".join(
            f"127.0.0.1:{port or k.sasl_port}" for port, k in zip(recorded, self.kafkas, strict=True)
        )
        return [
            f"export TASKQ_STACK_SASL_BOOTSTRAP={bootstrap}",
            f"export TASKQ_STACK_SASL_CA={shlex.quote(str(self.kafkas[0].tls / 'ca.pem'))}",
            f"export TASKQ_STACK_SASL_USERNAME={user[0]}",
            f"export TASKQ_STACK_SASL_PASSWORD={user[1]}",
        ]

    def expand(self, names: list[str]) -> list[str]:
        """Service names, with `kafka` standing for every Kafka node."""
        return [m for n in names for m in ([k.name for k in self.kafkas] if n == "kafka" else [n])]

    def closure(self, names: list[str]) -> list[str]:
        want: set[str] = set()
        for n in self.expand(names):
            want.add(n)
            want.update(DEPENDS.get(n, ()))
        return [n for n in self.names if n in want]

    def up(self, names: list[str]) -> None:
        self.cfg.state.mkdir(parents=True, exist_ok=True)
        os.chmod(self.cfg.state, 0o755)
        names = self.closure(names)
        if any(k.name in names for k in self.kafkas):
            (self.cfg.state / "kafka.brokers").write_text(f"{len(self.kafkas)}\n")
        t0 = time.monotonic()
        todo: list[Service] = []
        # Ours but not answering: still starting from an earlier `up`, or waiting for a dependency that was
        # stopped (the registry without Postgres). Each gets the timeout; one with dependencies once they
        # are up.
        pending: list[Service] = []
        for n in names:
            svc = self.by_name[n]
            pid = svc.ours_alive()
            if pid is not None:
                if svc.answering():
                    log(f"{n}: already running (pid {pid}, port {svc.recorded_port()})")
                else:
                    log(f"{n}: pid {pid} is ours but not answering yet; waiting")
                    if DEPENDS.get(n):
                        pending.append(svc)
                    else:
                        self.wait(svc, launched=False)
                continue
            svc.clear_record()
            for port in svc.ports():
                if not port_free(port):
                    raise StackError(
                        f"port {port} (needed by {n}) is already in use by a process this stack did not "
                        f"start; stop it or choose another port ({svc.port_env}=...)"
                    )
            todo.append(svc)

        # Fetching/extracting/initialising is independent per service: do it concurrently.
        errors: list[BaseException] = []

        def prep(s: Service) -> None:
            try:
                s.prepare()
            except BaseException as e:
                errors.append(e)

        threads = [
            threading.Thread(target=prep, args=(s,), daemon=True) for s in todo if s is not self.postgres
        ]
        for t in threads:
            t.start()
        if self.postgres in todo:
            self.postgres.prepare()
            log(f"postgres: starting on 127.0.0.1:{self.postgres.port}")
            self.postgres.launch()
            self.wait(self.postgres, launched=True)
        if "postgres" in names:
            self.postgres.after_ready()
        for t in threads:
            t.join()
        if errors:
            for e in errors[1:]:
                log(f"error: {e}")
            raise errors[0]

        # Kafka's nodes and the registry start together (a cluster's nodes wait for each other's quorum),
        # then we wait for each.
        started = [s for s in todo if s is not self.postgres]
        for s in started:
            extra = f" (+ controller {s.controller_port})" if isinstance(s, Kafka) else ""
            log(f"{s.name}: starting on 127.0.0.1:{s.port}{extra}")
            s.launch()
        for s in started:
            self.wait(s, launched=True)
        for s in pending:
            self.wait(s, launched=False)
        for n in names:
            if n != "postgres":
                self.by_name[n].after_ready()
        log(f"up: {', '.join(names)} answering ({time.monotonic() - t0:.1f}s)")

    def wait(self, svc: Service, launched: bool) -> None:
        deadline = time.monotonic() + self.cfg.timeout
        t0 = time.monotonic()
        check = svc.ready_after_launch if (launched and isinstance(svc, Kafka)) else svc.answering
        while True:
            if check():
                log(f"{svc.name}: answering after {time.monotonic() - t0:.1f}s (pid {svc.pid()})")
                if launched:
                    svc.write_record()
                return
            logfile = svc.server_log if isinstance(svc, Kafka) and svc.server_log.exists() else svc.log_path
            if svc.exited():
                code = svc.proc.returncode if svc.proc is not None else "?"
                svc.clear_record()
                if isinstance(svc, Kafka) and logfile != svc.log_path:
                    log(f"{svc.name} stdout/stderr ({svc.log_path}):\n{tail(svc.log_path, 15)}")
                raise svc.fail(f"exited during start-up (exit code {code})", logfile)
            if time.monotonic() > deadline:
                err = svc.fail(f"did not answer within {self.cfg.timeout:.0f}s; stopping it", logfile)
                with contextlib.suppress(Exception):
                    svc.stop()
                raise err
            time.sleep(0.5)

    def down(self, names: list[str]) -> None:
        names = self.expand(names)
        # A cluster's nodes stop together: one by one, the last would wait for a controller quorum that
        # the others took away.
        kafkas = [k for k in self.kafkas if k.name in names]
        stoppers = [threading.Thread(target=k.stop, daemon=True) for k in kafkas]
        if "registry" in names:
            self.registry.stop()
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()
        if "postgres" in names:
            self.postgres.stop()

    def kill(self, names: list[str]) -> None:
        for n in self.expand(names):
            self.by_name[n].kill()

    def status(self) -> int:
        ok = True
        for n in self.names:
            svc = self.by_name[n]
            pid = svc.ours_alive()
            port = svc.recorded_port()
            if pid is None:
                print(f"{n:9} stopped")
                ok = False
            elif svc.answering():
                print(f"{n:9} running  pid {pid}  port {port}")
            else:
                print(f"{n:9} not answering  pid {pid}  port {port}  (log: {svc.log_path})")
                ok = False
        return 0 if ok else 3


def _split_brokers(cmd: str, args: list[str]) -> tuple[int | None, list[str]]:
    """`--brokers N` (or `--brokers=N`) taken out of `args`: (N or None, the other arguments)."""
    brokers: int | None = None
    rest: list[str] = []
    it = iter(args)
    for a in it:
        if a != "--brokers" and not a.startswith("--brokers="):
            rest.append(a)
            continue
        if cmd not in ("up", "start", "restart"):
            die(f"`{cmd}` takes no --brokers (only up, start and restart do)", 2)
        raw = a.partition("=")[2] if "=" in a else next(it, "")
        if not raw.isdigit() or not 1 <= int(raw) <= MAX_BROKERS:
            die(f"--brokers takes a number of Kafka nodes from 1 to {MAX_BROKERS}, got {raw!r}", 2)
        brokers = int(raw)
    return brokers, rest


def main(argv: list[str], environ: Mapping[str, str] | None = None) -> int:
    """Run one command; the environment (`environ`, default os.environ) is read here, once."""
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__, file=sys.stderr)
        return 0 if argv else 2
    cmd = argv[0]
    brokers, rest = _split_brokers(cmd, argv[1:])
    try:
        cfg = StackConfig.from_env(os.environ if environ is None else environ)
        stack = Stack(cfg, brokers_of(cfg, brokers))
        if cmd in ("start", "stop", "restart", "kill"):
            choices = ["kafka", *stack.names] if len(stack.kafkas) > 1 else stack.names
            if len(rest) != 1 or rest[0] not in choices:
                die(f"usage: compose/stack {cmd} {{{'|'.join(choices)}}}", 2)
        elif rest:
            die(f"`{cmd}` takes no arguments", 2)
        if cmd == "up":
            stack.up(stack.names)
            print("\n".join(stack.exports()), flush=True)
        elif cmd == "down":
            stack.down(stack.names)
            log("down: stopped")
        elif cmd == "status":
            return stack.status()
        elif cmd == "env":
            print("\n".join(stack.exports()))
        elif cmd == "start":
            stack.up(rest)
            print("\n".join(stack.exports()), flush=True)
        elif cmd == "stop":
            stack.down(rest)
        elif cmd == "kill":
            stack.kill(rest)
        elif cmd == "restart":
            stack.down(rest)
            stack.up(rest)
            print("\n".join(stack.exports()), flush=True)
        else:
            die(f"unknown command {cmd!r}; try --help", 2)
    except StackError as e:
        die(str(e))
    except KeyboardInterrupt:
        die("interrupted", 130)
    return 0
