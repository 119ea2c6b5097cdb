"""Client-side TLS for the internal planes (NATS, Redis): one SSL context from a CA bundle and an optional
client certificate, with errors that name the setting to fix."""

from __future__ import annotations

import ssl


def client_context(variable_prefix: str, ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext:
    """Verifies the server against `ca` (the system's CAs when None) and its host name; presents `cert` and
    `key` when given (servers that verify clients). `variable_prefix` (e.g. PDSERVE_NATS_TLS) names the
    variables in error messages."""
    if (cert is None) != (key is None):
        raise ValueError(f"{variable_prefix}_CERT and {variable_prefix}_KEY go together: set both or neither")
    try:
        context = ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"{variable_prefix}_CA={ca!r} is not a readable CA bundle: {_reason(exc)}") from exc
    if cert is not None:
        try:
            context.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(
                f"{variable_prefix}_CERT={cert!r} / {variable_prefix}_KEY={key!r}: not a usable certificate and "
                f"key: {_reason(exc)}"
            ) from exc
    return context


def _reason(exc: Exception) -> str:
    return getattr(exc, "strerror", None) or getattr(exc, "reason", None) or str(exc)
