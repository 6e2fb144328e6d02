"""The schema registry's REST API (Confluent's, e.g. Apicurio's ccompat) over the standard library's HTTP.

The registry client needs a handful of JSON calls. Made with urllib they cost no import beyond the standard
library, where confluent-kafka's client brought an HTTP and an OAuth library that took a few hundred
milliseconds to import on every producer's and worker's start. The behaviour follows that client's:
- credentials from `basic.auth.user.info`, the URL's user info, or a static bearer token;
- TLS verified against `ssl.ca.location` (else the system's CAs), with a client certificate if given;
- up to 3 retries with full-jitter backoff (1 s doubling, at most 20 s) on a transport failure and on
  HTTP 408, 429, 500, 502, 503 and 504; a certificate that fails verification is not retried.
"""

from __future__ import annotations

import base64
import http.client
import json
import random
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any

#: Statuses worth asking again for: the registry busy, restarting or behind a proxy that timed out.
RETRIABLE = frozenset({408, 429, 500, 502, 503, 504})
ACCEPT = "application/vnd.schemaregistry.v1+json, application/vnd.schemaregistry+json, application/json"
CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"


class RegistryHTTPError(Exception):
    """The registry answered with an error: its HTTP status, its error code (-1 if none) and message."""

    def __init__(self, status: int, error_code: int, message: str) -> None:
        super().__init__(f"{message} (HTTP {status}, error code {error_code})")
        self.status, self.error_code, self.message = status, error_code, message


class RegistryTransportError(OSError):
    """No answer: the connection failed, was cut, or the answer was not HTTP."""


class RestClient:
    """JSON calls to the registry at `url` with confluent-kafka's client properties in `config`."""

    def __init__(
        self,
        url: str,
        config: Mapping[str, Any],
        *,
        timeout: float = 5.0,
        max_retries: int = 3,
        retry_wait: float = 1.0,
        retry_max_wait: float = 20.0,
    ) -> None:
        """Raises OSError (ssl.SSLError among them) for TLS files that cannot be used."""
        parts = urllib.parse.urlsplit(url)
        netloc = parts.hostname or ""
        if ":" in netloc:
            netloc = f"[{netloc}]"  # an IPv6 address
        if parts.port is not None:
            netloc += f":{parts.port}"
        self._base = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
        self._headers = {"Accept": ACCEPT}
        user_info = str(config.get("basic.auth.user.info") or "")
        if not user_info and parts.username is not None:
            user_info = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        if user_info:
            self._headers["Authorization"] = "Basic " + base64.b64encode(user_info.encode()).decode()
        token = config.get("bearer.auth.token")
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
            # Confluent Cloud's routing headers; other registries read only Authorization.
            if config.get("bearer.auth.logical.cluster"):
                self._headers["target-sr-cluster"] = str(config["bearer.auth.logical.cluster"])
            if config.get("bearer.auth.identity.pool.id"):
                self._headers["Confluent-Identity-Pool-Id"] = str(config["bearer.auth.identity.pool.id"])
        self._tls: ssl.SSLContext | None = None
        if parts.scheme == "https":
            self._tls = ssl.create_default_context(cafile=config.get("ssl.ca.location") or None)
            cert = config.get("ssl.certificate.location")
            if cert:
                self._tls.load_cert_chain(
                    cert, config.get("ssl.key.location") or None, config.get("ssl.key.password") or None
                )
        self._timeout = timeout
        self._max_retries = max_retries
        self._retry_wait = retry_wait
        self._retry_max_wait = retry_max_wait

    def get(self, path: str) -> Any:
        """GET `path` (relative to the registry's URL); the answer's JSON."""
        return self.request("GET", path)

    def post(self, path: str, body: Any) -> Any:
        """POST `body` as JSON to `path`; the answer's JSON."""
        return self.request("POST", path, body)

    def put(self, path: str, body: Any) -> Any:
        """PUT `body` as JSON to `path`; the answer's JSON."""
        return self.request("PUT", path, body)

    def delete(self, path: str) -> Any:
        """DELETE `path`; the answer's JSON."""
        return self.request("DELETE", path)

    def request(self, method: str, path: str, body: Any = None) -> Any:
        """One call, retried as the module docstring says. RegistryHTTPError for an error answer,
        RegistryTransportError (or ssl.SSLError) when none came."""
        data = None if body is None else json.dumps(body).encode()
        headers = dict(self._headers)
        if data is not None:
            headers["Content-Type"] = CONTENT_TYPE
        url = f"{self._base}/{path.lstrip('/')}"
        for attempt in range(self._max_retries + 1):
            last = attempt >= self._max_retries
            request = urllib.request.Request(url, data=data, headers=headers, method=method)
            try:
                with urllib.request.urlopen(request, timeout=self._timeout, context=self._tls) as answer:
                    content = answer.read()
                    status = answer.status
            except urllib.error.HTTPError as err:
                try:
                    error = _error_of(err.code, err.read() if err.fp is not None else b"")
                finally:
                    err.close()
                if err.code not in RETRIABLE or last:
                    raise error from None
            except ssl.SSLCertVerificationError:
                raise  # the same certificate next time
            except urllib.error.URLError as err:
                reason = err.reason
                if isinstance(reason, ssl.SSLCertVerificationError):
                    raise reason from None
                if last:
                    raise RegistryTransportError(str(reason)) from err
            except (OSError, http.client.HTTPException) as err:
                if last:
                    raise RegistryTransportError(f"{type(err).__name__}: {err}") from err
            else:
                try:
                    return json.loads(content) if content else None
                except ValueError:
                    raise _error_of(status, content) from None
            delay = min(self._retry_wait * 2**attempt, self._retry_max_wait)
            time.sleep(random.random() * delay)  # full jitter, as confluent-kafka's client waits
        raise AssertionError("unreachable")  # the last attempt returns or raises

    def close(self) -> None:
        """Nothing to release: each call opens and closes its own connection."""


def _error_of(status: int, content: bytes) -> RegistryHTTPError:
    try:
        body = json.loads(content)
        return RegistryHTTPError(status, int(body.get("error_code", -1)), str(body.get("message", "")))
    except (ValueError, TypeError, AttributeError):
        text = content.decode(errors="replace").strip().replace("\n", " ")[:200]
        return RegistryHTTPError(status, -1, f"Unknown Schema Registry Error: {text}")
