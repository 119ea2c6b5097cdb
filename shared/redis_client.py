"""The one place a Redis client is made: settings.redis_url with its credentials and TLS options."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from shared.settings import CommonSettings


def redis_client(settings: CommonSettings, **kwargs: Any) -> Redis:
    """A client of settings.redis_url; `kwargs` go to redis.asyncio.Redis (timeouts, say)."""
    return Redis.from_url(settings.redis_url, **kwargs)
