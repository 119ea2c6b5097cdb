"""Server URLs that may carry credentials (`scheme://user:password@host:port/...`): split them out, put them
in, and write a URL so that a log line never shows a password."""

from __future__ import annotations

from urllib.parse import quote, unquote, urlsplit, urlunsplit


def split_credentials(url: str) -> tuple[str, str | None, str | None]:
    """(the URL without user info, its user name, its password); names and passwords percent-decoded."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, None, None
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, has_password, password = userinfo.partition(":")
    bare = urlunsplit(parts._replace(netloc=hostport))
    return bare, unquote(user) or None, unquote(password) if has_password else None


def with_credentials(url: str, user: str | None, password: str | None) -> str:
    """`url` (its own user info replaced) carrying `user` and `password`, percent-encoded."""
    bare, _, _ = split_credentials(url)
    if user is None and password is None:
        return bare
    parts = urlsplit(bare)
    userinfo = quote(user or "", safe="") + (":" + quote(password, safe="") if password is not None else "")
    return urlunsplit(parts._replace(netloc=f"{userinfo}@{parts.netloc}"))


def redact(url: str) -> str:
    """`url` fit for a log line: any user info (a password, or a token in the user's place) becomes ***.
    Comma-separated server lists are redacted one by one."""
    if "," in url:
        return ",".join(redact(u.strip()) for u in url.split(","))
    bare, user, password = split_credentials(url)
    if user is None and password is None:
        return url
    parts = urlsplit(bare)
    return urlunsplit(parts._replace(netloc=f"***@{parts.netloc}"))
