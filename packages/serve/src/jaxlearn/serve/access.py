"""Who may use the server: the Host header (parsed strictly, against an allowlist), the
Origin header (CORS), the API key; and `HTTPError`, the error response every check raises.
See httpd.py for where these apply."""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import re
from typing import Iterable, Optional

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


class HTTPError(Exception):
    """An error response: status, message, the request field at fault, extra headers."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers or {}


def host_name(value: str) -> str:
    """The name of a Host header or allowlist entry, lowercased, without port:
    "LocalHost:8000" -> "localhost", "[::1]:80" -> "::1"."""
    v = value.strip().lower()
    if v.startswith("["):
        v = v[1:v.find("]")] if "]" in v else v[1:]
    elif v.count(":") == 1:
        v = v.split(":")[0]
    try:
        return str(ipaddress.IPv6Address(v))  # One spelling per address, as parse_host's.
    except ValueError:
        return v.rstrip(".")


# host[:port]: a name (labels of letters, digits, "-", "_") or IPv4 address, or an IPv6
# address in brackets; port digits only. Nothing else: no userinfo ("a@b"), nothing after
# "]" but ":port".
_HOST = re.compile(r"(?:\[([0-9A-Fa-f:.]+)\]|([A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*\.?))"
                   r"(?::([0-9]{1,5}))?")


def parse_host(value: str) -> str:
    """The name of a Host header value parsed strictly as host[:port] (see `_HOST`),
    lowercased, without port or trailing dot; ValueError saying what is wrong."""
    m = _HOST.fullmatch(value.strip(" \t"))
    if m is None:
        raise ValueError("expected host[:port] (a name, an IPv4 address or [an IPv6 "
                         "address]; port digits only)")
    ipv6, name, port = m.groups()
    if port is not None and int(port) > 65535:
        raise ValueError(f"port {port} is over 65535")
    if ipv6 is not None:
        try:
            return str(ipaddress.IPv6Address(ipv6))
        except ValueError:
            raise ValueError(f"[{ipv6}] is not an IPv6 address") from None
    return name.lower().rstrip(".")


def is_loopback(host: str) -> bool:
    if host_name(host) == "localhost":
        return True
    try:
        return ipaddress.ip_address(host_name(host)).is_loopback
    except ValueError:
        return False


@dataclasses.dataclass(frozen=True)
class Policy:
    """Who may use the server. allowed_hosts None: any Host header; allowed_origins
    empty: CORS off (requests carrying an Origin header are refused); "*": any."""

    api_key: Optional[str] = None
    allowed_hosts: Optional[frozenset[str]] = None
    allowed_origins: frozenset[str] = frozenset()
    public_paths: frozenset[str] = frozenset({"/health"})

    @classmethod
    def for_bind(cls, bind_host: str, *, api_key: Optional[str] = None,
                 allowed_hosts: Iterable[str] = (),
                 allowed_origins: Iterable[str] = ()) -> "Policy":
        """Loopback names plus `allowed_hosts` when bound to loopback; otherwise
        `allowed_hosts` alone, or any Host when none is given ("*" allows any)."""
        if api_key is not None and not api_key.strip():
            raise ValueError("api_key: must not be empty")
        hosts = {host_name(h) for h in allowed_hosts if h.strip()}
        if is_loopback(bind_host):
            hosts |= LOOPBACK_HOSTS
        any_host = "*" in hosts or not hosts
        origins = frozenset(o.strip().rstrip("/").lower() for o in allowed_origins if o.strip())
        return cls(api_key, None if any_host else frozenset(hosts), origins)

    def check_host(self, hosts: list[str]) -> None:
        """The request's Host header values: one, well-formed (`parse_host`), allowed."""
        if len(hosts) > 1:
            raise HTTPError(400, f"{len(hosts)} Host headers; send one")
        if not hosts:
            if self.allowed_hosts is None:
                return
            raise HTTPError(400, "the Host header is required")
        host = hosts[0]
        try:
            name = parse_host(host)
        except ValueError as e:
            raise HTTPError(400, f"Host {host[:100]!r} is malformed: {e}") from None
        if self.allowed_hosts is not None and name not in self.allowed_hosts:
            allowed = ", ".join(sorted(self.allowed_hosts))
            raise HTTPError(400, f"Host {host[:100]!r} is not allowed (allowed: {allowed}; "
                                 f"see --allowed_hosts)")

    def cors_origin(self, origin: Optional[str]) -> Optional[str]:
        """The origin to answer with CORS headers (None: no Origin header); 403 if refused."""
        if origin is None:
            return None
        o = origin.strip().rstrip("/").lower()
        if "*" in self.allowed_origins or o in self.allowed_origins:
            return origin.strip()
        raise HTTPError(403, f"Origin {origin[:100]!r} is not allowed (cross-origin requests "
                             f"are off unless listed in --allowed_origins)")

    def check_key(self, path: str, authorization: Optional[str],
                  x_api_key: Optional[str] = None) -> None:
        """The key as `Authorization: Bearer <key>` (OpenAI clients) or `x-api-key: <key>`
        (Anthropic clients)."""
        if self.api_key is None or path in self.public_paths:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            token = x_api_key or ""
        if not hmac.compare_digest(token.strip().encode("latin-1", "replace"),
                                   self.api_key.encode()):
            raise HTTPError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' "
                                 "or 'x-api-key: <key>'", headers={"WWW-Authenticate": "Bearer"})
