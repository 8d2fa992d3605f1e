"""Who may call the server: API keys, their two scopes, and the check every request passes first.

    --api-key KEY (repeatable), --api-key-file FILE, MINILLM_API_KEY   inference keys: generate; see their
                                                                       own requests' traces and events
    --observer-key KEY (repeatable)                                    the projector's: GET /ui, /v1/events,
                                                                       /v1/traces, /metrics, /v1/models; never generates

    no ``Authorization: Bearer`` header, or a key the server does not hold  -> 401 + WWW-Authenticate: Bearer
    an observer key on POST /v1/chat/completions or /v1/completions        -> 403
    GET /health                                                            -> never asks (load balancers probe it)

Without any key the server is open, as a server on 127.0.0.1 for one user should be; on any other
``--host`` it refuses to start unless ``--no-auth`` says that is meant (:func:`access_from_args`,
before the socket is bound). A browser that opens ``/ui`` without a key gets the page itself with the
401: the page then asks for the key and sends it as a header (``static/ui.html``).

Keys are compared in constant time: the SHA-256 digest of the key sent against the digest of every
key the server holds, each with ``hmac.compare_digest``, with no early exit. A key is known to the
server's output only by its *label*, the first 8 hex digits of its SHA-256 (``/metrics``, traces,
the console); never the key itself.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

from starlette.responses import Response

from .responses import APIError

ENV_KEY = "MINILLM_API_KEY"  # one inference key, for those who keep keys out of the command line
GENERATION = frozenset({"/v1/chat/completions", "/v1/completions"})  # what an observer key may not call
PUBLIC = frozenset({"/health"})
LOGIN_PAGE = "/ui"  # a browser opening it without a key gets the page (which asks for one) with the 401


def label(key: str) -> str:
    """A key's name in the server's output: the first 8 hex digits of its SHA-256 (never the key)."""
    return hashlib.sha256(key.encode()).hexdigest()[:8]


@dataclass(frozen=True)
class Caller:
    """Who sent a request: ``scope`` is ``inference``, ``observer``, or ``open`` (the server holds no
    keys: everything allowed); ``label`` is its key's :func:`label`, None when open."""

    scope: str
    label: str | None = None


OPEN = Caller("open")


class KeyRing:
    """The keys a server holds, by scope; :meth:`identify` finds a key's caller in constant time.

    Args:
        inference: keys that may generate.
        observer: keys that may only watch.
    """

    def __init__(self, inference: list[str] | tuple = (), observer: list[str] | tuple = ()):
        self._entries = [(_digest(k), Caller("inference", label(k))) for k in inference]
        self._entries += [(_digest(k), Caller("observer", label(k))) for k in observer]

    @property
    def enabled(self) -> bool:
        """True when the server holds at least one key (then every endpoint but /health needs one)."""
        return bool(self._entries)

    def identify(self, key: str) -> Caller | None:
        """The caller ``key`` belongs to, or None. Every held key is compared, whatever matched first."""
        given, found = _digest(key), None
        for digest, caller in self._entries:
            if hmac.compare_digest(given, digest):
                found = caller
        return found

    def labels(self) -> list[Caller]:
        """Every held key as its caller (scope and label), in the order given."""
        return [caller for _, caller in self._entries]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class QuotaLimits:
    """Per key: requests started per minute, tokens (prompt + completion) per minute, requests in
    flight at once; None: no limit (``quotas.py`` applies them)."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    concurrent: int | None = None


@dataclass(frozen=True)
class Access:
    """Everything ``minillm serve`` was told about access: the keys, whether an observer sees other
    keys' text (``--show-prompts``), the origins a browser page elsewhere may call from
    (``--allowed-origin``; none: no CORS headers at all), and the per-key quotas."""

    keys: KeyRing = field(default_factory=KeyRing)
    show_prompts: bool = False
    allowed_origins: tuple[str, ...] = ()
    limits: QuotaLimits = field(default_factory=QuotaLimits)

    def banner(self) -> str:
        """One line for the console: how many keys of each scope, by label; what observers see."""
        if not self.keys.enabled:
            return "minillm serve: no API keys: anyone who reaches this port may generate and watch"
        callers = self.keys.labels()
        said = []
        for scope in ("inference", "observer"):
            labels = [c.label for c in callers if c.scope == scope]
            if labels:
                said.append(f"{len(labels)} {scope} key{'s' * (len(labels) != 1)} ({', '.join(labels)})")
        shown = "shown" if self.show_prompts else "hidden (--show-prompts shows them)"
        return f"minillm serve: {' and '.join(said)}; other keys' prompts and answers are {shown} to observers"


def refusal(status: int, message: str, code: str, error: str | None = None) -> APIError:
    """A 401 (with RFC 6750's ``WWW-Authenticate: Bearer``, naming ``error`` if given) or a 403."""
    challenge = 'Bearer realm="minillm"' + (f', error="{error}"' if error else "")
    type_ = "invalid_request_error" if status == 401 else "permission_error"
    return APIError(status, message, type_, code=code, headers={"WWW-Authenticate": challenge})


class KeyCheck:
    """ASGI wrapper in front of every route: who is calling (``scope["state"]["caller"]``), or the
    401 / 403 answered before the route runs. ``login_page()`` gives the live page's HTML (None if
    missing): a browser that opens ``/ui`` without a key gets it with the 401."""

    def __init__(self, app, keys: KeyRing, login_page=None):
        self.app, self.keys, self.login_page = app, keys, login_page

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        caller, refused = self.check(scope)
        if refused is None:
            scope.setdefault("state", {})["caller"] = caller
            return await self.app(scope, receive, send)
        response = refused.response()
        page = self.login_page() if self.login_page and scope["path"] == LOGIN_PAGE and _wants_html(scope) else None
        if page is not None and refused.status == 401:  # the page asks for the key (it holds no data)
            response = Response(page, 401, refused.headers, media_type="text/html; charset=utf-8")
        await response(scope, receive, send)

    def check(self, scope) -> tuple[Caller, APIError | None]:
        """(the caller, None) when the request may go on, else (OPEN, the 401 or 403 to answer)."""
        if not self.keys.enabled or scope["path"] in PUBLIC:
            return OPEN, None
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        scheme, _, key = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return OPEN, refusal(
                401,
                "this server needs an API key: send the header `Authorization: Bearer KEY` (the openai "
                "client's api_key=...); whoever runs the server gives out the keys",
                "missing_api_key",
            )
        caller = self.keys.identify(key.strip())
        if caller is None:
            return OPEN, refusal(
                401,
                "the API key sent is not one this server holds; check it for a typo or a stray character",
                "invalid_api_key",
                "invalid_token",
            )
        if caller.scope == "observer" and scope["path"] in GENERATION:
            return caller, refusal(
                403,
                f"an observer key may watch (GET /ui, /v1/events, /v1/traces, /metrics) but not generate: "
                f"{scope['method']} {scope['path']} needs an inference key (minillm serve --api-key)",
                "insufficient_scope",
                "insufficient_scope",
            )
        return caller, None


def _wants_html(scope) -> bool:
    return b"text/html" in dict(scope.get("headers") or []).get(b"accept", b"")


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1): only this machine can connect."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to an address others reach
        return False


def access_from_args(args: argparse.Namespace) -> Access:
    """``minillm serve``'s access flags as an :class:`Access`, checked before any socket is bound.

    Raises:
        ValueError: a key file that cannot be read or holds no key, an empty key or one with spaces, a
            key given as both scopes, ``--no-auth`` beside keys, quotas without keys, or a non-loopback
            ``--host`` without keys and without ``--no-auth`` (the message names ``--api-key`` and ``--no-auth``).
    """
    inference = list(args.api_key) + [k for f in args.api_key_file for k in read_key_file(f)]
    if os.environ.get(ENV_KEY, "").strip():
        inference.append(os.environ[ENV_KEY].strip())
    observer = list(args.observer_key)
    for key in inference + observer:
        if not key or any(c.isspace() for c in key):
            raise ValueError("an API key is one word, no spaces: check --api-key, --api-key-file and --observer-key")
    if set(inference) & set(observer):
        raise ValueError("a key is given both as --api-key and as --observer-key; give each key one scope")
    keys = KeyRing(inference, observer)
    if args.no_auth and keys.enabled:
        raise ValueError("--no-auth and API keys contradict each other: drop --no-auth, or the keys")
    limits = QuotaLimits(args.requests_per_minute, args.tokens_per_minute, args.max_concurrent_per_key)
    if not keys.enabled and any(v is not None for v in vars(limits).values()):
        raise ValueError("quotas are per key: give keys with --api-key (or --api-key-file) to use them")
    if any(v is not None and v < 1 for v in vars(limits).values()):
        raise ValueError("--requests-per-minute, --tokens-per-minute and --max-concurrent-per-key must be >= 1")
    if not keys.enabled and not args.no_auth and not is_loopback(args.host):
        raise ValueError(
            f"refusing to serve on --host {args.host} without API keys: anyone who reaches it could generate and "
            "read every request's prompt and answer. Give keys with --api-key KEY (or --api-key-file FILE, or "
            f"the {ENV_KEY} environment variable), or pass --no-auth if an open server is really what you mean"
        )
    return Access(keys, args.show_prompts, tuple(args.allowed_origin), limits)


def read_key_file(path: str) -> list[str]:
    """The keys in a file, one a line; blank lines and ``#`` comments (whole lines or after a key) skipped.

    Raises:
        ValueError: the file cannot be read, or holds no key (the message names the file, never a key).
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read --api-key-file {path}: {exc.strerror or exc}") from None
    keys = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    keys = [k for k in keys if k]
    if not keys:
        raise ValueError(f"--api-key-file {path} holds no key (one key a line; # starts a comment)")
    return keys
