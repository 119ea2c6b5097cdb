"""The one place a Redis client is made: settings.redis_url with its credentials and TLS options, or, with
settings.redis_sentinels, the primary those Sentinels name, followed across failovers."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

from redis.asyncio import Redis
from redis.asyncio.sentinel import Sentinel
from redis.exceptions import AuthenticationError, AuthorizationError, ResponseError

from shared.settings import CommonSettings
from shared.tls import client_context
from shared.urls import split_credentials


def redis_client(settings: CommonSettings, **kwargs: Any) -> Redis:
    """A client of settings.redis_url; `kwargs` go to redis.asyncio.Redis (timeouts, say).

    Credentials: settings.redis_username / redis_password, else the URL's. TLS when the URL is rediss:// or
    settings.redis_tls_ca is set (a redis:// URL then becomes rediss://): the server's certificate and host
    name are verified against that CA (the system's when unset), and settings.redis_tls_cert / _key are
    presented to servers that verify clients. With settings.redis_sentinels: see sentinel_client."""
    url, user, password = split_credentials(settings.redis_url)
    options: dict[str, Any] = {
        "username": settings.redis_username or user,
        "password": settings.redis_password or password,
    }
    parts = urlsplit(url)
    tls: dict[str, Any] = {}
    if settings.redis_tls_ca or settings.redis_tls_cert or parts.scheme == "rediss":
        # Checked here, so a wrong path fails at start with the variable's name, not at the first command.
        client_context("PDSERVE_REDIS_TLS", settings.redis_tls_ca, settings.redis_tls_cert, settings.redis_tls_key)
        url = urlunsplit(parts._replace(scheme="rediss"))
        tls = {
            "ssl_ca_certs": settings.redis_tls_ca,
            "ssl_certfile": settings.redis_tls_cert,
            "ssl_keyfile": settings.redis_tls_key,
            "ssl_cert_reqs": "required",
            "ssl_check_hostname": True,
        }
    if settings.redis_sentinels:
        database = int(parts.path.strip("/") or 0)
        return sentinel_client(settings, database, options | kwargs, tls)
    return Redis.from_url(url, **(options | tls | kwargs))


def sentinel_client(settings: CommonSettings, database: int, options: dict[str, Any], tls: dict[str, Any]) -> Redis:
    """The primary the Sentinels of settings.redis_sentinels name for settings.redis_sentinel_master. Each new
    connection asks them again (redis-py's SentinelConnectionPool), and one that finds a demoted primary (a
    READONLY answer) drops and asks again: after a failover the next commands reach the new primary; those in
    between fail fast (connection refused, no primary known yet) and the callers' own fallbacks apply. The
    Sentinels are asked with the same credentials, timeouts and TLS as Redis itself (they share its password)."""
    addresses = [(host, int(port)) for host, _, port in (a.rpartition(":") for a in settings.redis_sentinels)]
    if tls:
        tls = tls | {"ssl": True}  # the pool's connection class and the Sentinels' clients take TLS so
    sentinels = Sentinel(addresses, sentinel_kwargs=options | tls, **(options | tls))
    return sentinels.master_for(settings.redis_sentinel_master, db=database)


def explain_redis_error(exc: Exception) -> str:
    """A Redis failure as one line that says what to fix when the cause is the credentials."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, AuthenticationError | AuthorizationError) or (
        isinstance(exc, ResponseError) and str(exc).startswith(("NOAUTH", "WRONGPASS", "NOPERM"))
    ):
        return f"Redis refused the credentials ({text}): check PDSERVE_REDIS_USERNAME and PDSERVE_REDIS_PASSWORD"
    if "certificate" in text.lower() or "ssl" in text.lower():
        return f"TLS failed ({text}): check PDSERVE_REDIS_TLS_CA (and _CERT / _KEY where clients are verified)"
    return text
