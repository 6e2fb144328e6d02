"""Registry credentials and TLS from settings, against a real HTTPS registry that checks them.

Apicurio here takes no credentials, so the registry is a small one served by the test: real sockets, real
TLS with a CA made for the test by `openssl`, and the Confluent REST endpoints the client uses.
"""

from __future__ import annotations

import base64
import json
import re
import ssl
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from taskq._core.errors import ConfigurationError
from taskq._core.settings import Settings
from taskq.schemas import Registry, RegistryUnavailableError, SchemaError

SCHEMA = {"type": "record", "name": "Order", "namespace": "auth", "fields": [{"name": "id", "type": "string"}]}


@dataclass(frozen=True)
class Pki:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl(
        "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=taskq test CA",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=d,
    )  # fmt: skip
    for name, usage, san in (("server", "serverAuth", "subjectAltName=IP:127.0.0.1\n"), ("client", "clientAuth", "")):
        (d / f"{name}.ext").write_text(
            f"{san}basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage={usage}\n"
            "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n"
        )
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=taskq {name}", cwd=d)
        _openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext",
            cwd=d,
        )  # fmt: skip
    return Pki(d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem", d / "client.key")


@dataclass
class FakeRegistryState:
    """What the served registry holds and saw."""

    authorization: str | None
    subjects: dict[str, list[int]] = field(default_factory=dict)
    schemas: dict[int, str] = field(default_factory=dict)
    levels: dict[str, str] = field(default_factory=dict)
    seen: list[str | None] = field(default_factory=list)  # the Authorization header of every request


class _Handler(BaseHTTPRequestHandler):
    state: FakeRegistryState

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _answer(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method: str) -> None:
        st = self.state
        st.seen.append(self.headers.get("Authorization"))
        if st.authorization is not None and self.headers.get("Authorization") != st.authorization:
            return self._answer(401, {"error_code": 40101, "message": "Unauthorized"})
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        path = self.path.split("?")[0].removeprefix("/apis/ccompat/v7")
        if method == "GET" and path == "/subjects":
            return self._answer(200, sorted(st.subjects))
        if m := re.fullmatch(r"/config/([^/]+)", path):
            if method == "PUT":
                st.levels[m[1]] = body["compatibility"]
                return self._answer(200, {"compatibility": body["compatibility"]})
            if m[1] in st.levels:
                return self._answer(200, {"compatibilityLevel": st.levels[m[1]]})
            return self._answer(404, {"error_code": 40408, "message": "no compatibility level"})
        if m := re.fullmatch(r"/subjects/([^/]+)(/versions)?", path):
            subject, ids = m[1], st.subjects.setdefault(m[1], []) if m[2] else st.subjects.get(m[1], [])
            known = [i for i in ids if st.schemas[i] == body["schema"]]
            if m[2]:  # register
                if not known:
                    ids.append(len(st.schemas) + 1)
                    st.schemas[ids[-1]] = body["schema"]
                return self._answer(200, {"id": known[0] if known else ids[-1]})
            if not known:
                return self._answer(404, {"error_code": 40403, "message": "schema not found"})
            version = ids.index(known[0]) + 1
            return self._answer(200, {"subject": subject, "id": known[0], "version": version, "schema": body["schema"]})
        if m := re.fullmatch(r"/subjects/([^/]+)/versions/latest", path):
            if not st.subjects.get(m[1]):
                return self._answer(404, {"error_code": 40401, "message": "subject not found"})
            last = st.subjects[m[1]][-1]
            version = len(st.subjects[m[1]])
            return self._answer(200, {"subject": m[1], "id": last, "version": version, "schema": st.schemas[last]})
        if m := re.fullmatch(r"/schemas/ids/(\d+)", path):
            return self._answer(200, {"schema": st.schemas[int(m[1])]})
        return self._answer(404, {"error_code": 404, "message": f"no route {method} {path}"})

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")


@dataclass
class Served:
    url: str
    state: FakeRegistryState


def serve_registry(pki: Pki, *, authorization: str | None, client_ca: bool = False) -> Iterator[Served]:
    """An HTTPS registry on 127.0.0.1 that answers only requests carrying `authorization` (and, with
    `client_ca`, only clients with a certificate of the test CA)."""
    state = FakeRegistryState(authorization)
    handler = type("Handler", (_Handler,), {"state": state})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(pki.server_cert, pki.server_key)
    if client_ca:
        tls.verify_mode = ssl.CERT_REQUIRED
        tls.load_verify_locations(pki.ca)
    server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Served(f"https://127.0.0.1:{server.server_address[1]}/apis/ccompat/v7", state)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


PASSWORD = "pa ss@w0rd:%zz"  # a space, an '@', a ':' and a bad %-escape: none may break or leak


@pytest.fixture
def basic_registry(pki: Pki) -> Iterator[Served]:
    yield from serve_registry(pki, authorization=basic("ops", PASSWORD))


def test_basic_auth_and_the_ca_come_from_settings(pki: Pki, basic_registry: Served) -> None:
    s = Settings(
        schema_registry_url=basic_registry.url,
        schema_registry_user="ops",
        schema_registry_password=PASSWORD,
        schema_registry_ca_file=str(pki.ca),
    )
    with Registry.from_settings(s) as registry:
        reg = registry.register(SCHEMA)
        assert registry.latest("auth.Order").schema_id == reg.schema_id
        assert registry.subjects() == ["auth.Order"]
    with Registry.from_settings(s) as fresh:  # no cache: by id, from the registry itself
        assert fresh.by_id(reg.schema_id)["name"] == "auth.Order"
    assert basic_registry.state.seen and set(basic_registry.state.seen) == {basic("ops", PASSWORD)}


def test_a_bearer_token_comes_from_settings(pki: Pki) -> None:
    for served in serve_registry(pki, authorization="Bearer t0ken-abc"):
        s = Settings(
            schema_registry_url=served.url, schema_registry_token="t0ken-abc", schema_registry_ca_file=str(pki.ca)
        )
        with Registry.from_settings(s) as registry:
            assert registry.register(SCHEMA).version == 1
        assert set(served.state.seen) == {"Bearer t0ken-abc"}


def test_refused_credentials_fail_in_one_line_without_them(pki: Pki, basic_registry: Served) -> None:
    wrong = "wr0ng-secret"
    s = Settings(
        schema_registry_url=basic_registry.url,
        schema_registry_user="ops",
        schema_registry_password=wrong,
        schema_registry_ca_file=str(pki.ca),
    )
    with Registry.from_settings(s) as registry, pytest.raises(SchemaError) as err:
        registry.latest("auth.Order")
    message = str(err.value)
    assert "refused the credentials (HTTP 401)" in message and basic_registry.url in message
    assert wrong not in message and "\n" not in message

    token = Settings(
        schema_registry_url=basic_registry.url, schema_registry_token=wrong, schema_registry_ca_file=str(pki.ca)
    )
    with Registry.from_settings(token) as registry, pytest.raises(SchemaError) as err:
        registry.subjects()
    assert "HTTP 401" in str(err.value) and wrong not in str(err.value)


def test_the_registry_certificate_is_checked_against_the_ca_setting(basic_registry: Served) -> None:
    s = Settings(schema_registry_url=basic_registry.url, schema_registry_user="ops", schema_registry_password=PASSWORD)
    with Registry.from_settings(s) as registry, pytest.raises(RegistryUnavailableError) as err:
        registry.subjects()  # the test CA is not among the system's
    assert "CERTIFICATE_VERIFY_FAILED" in str(err.value) and PASSWORD not in str(err.value)
    assert basic_registry.state.seen == []  # no credentials went to an unverified server


def test_a_client_certificate_comes_from_settings(pki: Pki) -> None:
    for served in serve_registry(pki, authorization=None, client_ca=True):
        s = Settings(schema_registry_url=served.url, schema_registry_ca_file=str(pki.ca))
        with Registry.from_settings(s) as registry, pytest.raises(RegistryUnavailableError):
            registry.subjects()
        mutual = Settings(
            schema_registry_url=served.url,
            schema_registry_ca_file=str(pki.ca),
            schema_registry_cert_file=str(pki.client_cert),
            schema_registry_key_file=str(pki.client_key),
        )
        with Registry.from_settings(mutual) as registry:
            assert registry.subjects() == []


def test_tls_files_that_cannot_be_used_are_one_line_errors(pki: Pki, tmp_path: Path) -> None:
    missing = Settings(schema_registry_url="https://127.0.0.1:1", schema_registry_ca_file=str(tmp_path / "no.pem"))
    with pytest.raises(ConfigurationError, match=r"^TASKQ_SCHEMA_REGISTRY_CA_FILE: no such file '.*no\.pem'$"):
        Registry.from_settings(missing)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    bad = Settings(schema_registry_url="https://127.0.0.1:1", schema_registry_ca_file=str(garbage))
    with pytest.raises(ConfigurationError, match="schema registry client for https://127.0.0.1:1: ") as err:
        Registry.from_settings(bad)
    assert "\n" not in str(err.value)
