"""Access to a `minillm serve` with API keys, as the tests walk it: the documented status of every route
the app declares for each kind of caller, and a self-signed certificate for HTTPS.

:data:`ROUTES` is the documentation the walk checks; :func:`declared_routes` reads the routes from the app
itself (built in this process, no model loaded), so a route added to the app without a row here fails
the walk instead of being forgotten.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from pathlib import Path

import httpx

#: The callers of the walk, in the order of each row's statuses.
CALLERS = ("no key", "wrong key", "observer", "inference")
#: (method, path as the app declares it) -> the status each caller gets, in the order of :data:`CALLERS`.
#: /health never asks for a key; an observer watches but never generates; an inference key does both.
ROUTES = {
    ("GET", "/health"): (200, 200, 200, 200),
    ("GET", "/metrics"): (401, 401, 200, 200),
    ("GET", "/v1/models"): (401, 401, 200, 200),
    ("GET", "/v1/models/{model_id:path}"): (401, 401, 200, 200),  # OpenAI's retrieve, as /v1/models
    ("GET", "/v1/models/{model_id:path}/plan"): (401, 401, 200, 200),  # several models (multi_server.py)
    ("GET", "/v1/traces/{request_id}"): (401, 401, 200, 200),  # a trace of the inference key's own request
    ("GET", "/v1/events"): (401, 401, 200, 200),
    ("GET", "/ui"): (401, 401, 200, 200),  # a browser without a key gets the page (it asks) with the 401
    ("GET", "/openapi.json"): (401, 401, 200, 200),
    ("GET", "/docs"): (401, 401, 200, 200),
    ("GET", "/docs/oauth2-redirect"): (401, 401, 200, 200),
    ("GET", "/redoc"): (401, 401, 200, 200),
    ("POST", "/v1/chat/completions"): (401, 401, 403, 200),
    ("POST", "/v1/completions"): (401, 401, 403, 200),
}


def declared_routes(several: bool) -> set[tuple[str, str]]:
    """``(method, path)`` of every route the one-model app declares (``app.create_app``), plus the
    several-model server's own (``multi_server.add_routes``) when ``several``; HEAD left out."""
    from minillm.serve.app import create_app
    from minillm.serve.metrics import ServerMetrics
    from minillm.serve.multi_server import add_routes
    from minillm.serve.worker import Worker

    app = create_app(Worker("never-loaded", metrics=ServerMetrics()))  # never started: nothing is read
    if several:
        add_routes(app, registry=None)  # declares the route; the registry is read only when it is called
    return {(method, r.path) for r in app.routes for method in r.methods - {"HEAD"}}


def call(http: httpx.Client, method: str, path: str, headers: dict, fill: dict, bodies: dict) -> httpx.Response:
    """One request to a declared route: ``{name}`` and ``{name:path}`` in ``path`` from ``fill``, the body
    ``bodies[path]`` for a POST; the event stream is opened, its status read, and closed."""
    for name, value in fill.items():
        path = path.replace(f"{{{name}:path}}", value).replace(f"{{{name}}}", value)
    if path == "/v1/events":
        with http.stream("GET", path, headers=headers) as r:
            if r.status_code != 200:  # a refusal: its body is read (a stream's is not)
                r.read()
            return r
    return http.request(method, path, headers=headers, json=bodies[path] if method == "POST" else None)


def walk(http: httpx.Client, routes: set[tuple[str, str]], keys: dict[str, str | None], fill: dict, bodies: dict):
    """Call every route as every caller of :data:`CALLERS` (``keys``: caller -> key, None: no header; ``fill``
    and ``bodies`` as :func:`call` takes them) and return ``(route, caller, expected, got)`` for each call,
    the refusals' shape checked.

    A 401 must carry ``WWW-Authenticate: Bearer`` and OpenAI's error shape; a 403 the code ``insufficient_scope``."""
    calls = []
    for method, path in sorted(routes):
        for caller, expected in zip(CALLERS, ROUTES[method, path], strict=True):
            headers = {"Authorization": f"Bearer {keys[caller]}"} if keys[caller] is not None else {}
            r = call(http, method, path, headers, fill, bodies)
            calls.append(((method, path), caller, expected, r.status_code))
            if r.status_code in (401, 403):
                assert r.headers["www-authenticate"].startswith('Bearer realm="minillm"'), r.headers
                error = r.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}, error
                assert error["code"] == {401: "missing_api_key" if keys[caller] is None else "invalid_api_key",
                                         403: "insufficient_scope"}[r.status_code], error  # fmt: skip
    return calls


def self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, signed by its own key (``cryptography``), valid for a
    day: (certificate PEM, private key PEM) written in ``folder``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "minillm test")])
    now = datetime.datetime.now(datetime.UTC)
    names = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(names, critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


def trusting(cert: Path) -> ssl.SSLContext:
    """An SSL context that trusts ``cert`` (and nothing else): a client that verifies the test's server."""
    return ssl.create_default_context(cafile=str(cert))
