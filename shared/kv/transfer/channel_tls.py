"""Mutual TLS for the KV transfer plane's gRPC (Connect, Pull): the credentials of both ends.

Both ends hold the same three files: the CA that signs every worker's certificate (`kv_tls_ca`), and their
own certificate and key (`kv_tls_cert`, `kv_tls_key`). The prefill server presents its certificate and
requires one from every client, signed by the CA (`require_client_auth=True`); the decode client verifies
the server's certificate against the CA and its name against the host it dials (the advertised transfer
host), unless `kv_tls_server_name` names the one to expect instead. The files are read once, when a server
or client is built (a worker's start): an error names the setting to fix.

What this protects: tickets, pair ids and the announcements of the gRPC calls (read or altered on the wire
otherwise), and who may call at all. What it does not: the gloo/NCCL bytes (docs/security.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

_PREFIX = "PDSERVE_KV_TLS"


@dataclass(frozen=True)
class KvTls:
    """The PEM bytes of the CA, this worker's certificate and its key; `server_name` overrides the name the
    client checks in the server's certificate (None: the host it dials)."""

    ca: bytes
    cert: bytes
    key: bytes
    server_name: str | None = None

    @classmethod
    def load(cls, ca: str | None, cert: str | None, key: str | None, server_name: str | None = None) -> KvTls | None:
        """None when no file is set (plaintext gRPC); the files' contents when all three are; ValueError naming
        the settings when only some are, or a file cannot be read or is not PEM."""
        given = {"CA": ca, "CERT": cert, "KEY": key}
        if not any(given.values()):
            if server_name:
                raise ValueError(f"{_PREFIX}_SERVER_NAME is set without {_PREFIX}_CA, _CERT and _KEY")
            return None
        missing = [f"{_PREFIX}_{name}" for name, path in given.items() if not path]
        if missing:
            present = [f"{_PREFIX}_{name}" for name, path in given.items() if path]
            raise ValueError(
                f"KV transfer TLS needs {_PREFIX}_CA, {_PREFIX}_CERT and {_PREFIX}_KEY together: "
                f"{', '.join(present)} set but not {', '.join(missing)}"
            )
        assert ca and cert and key
        return cls(_read(ca, "CA", "CERTIFICATE"), _read(cert, "CERT", "CERTIFICATE"), _read(key, "KEY", "PRIVATE KEY"),
                   server_name or None)  # fmt: skip

    def server_credentials(self) -> grpc.ServerCredentials:
        """Present our certificate; accept only clients with a certificate the CA signed."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Verify the server against the CA; present our certificate."""
        return grpc.ssl_channel_credentials(self.ca, private_key=self.key, certificate_chain=self.cert)

    def channel_options(self) -> list[tuple[str, str]]:
        """The name checked in the server's certificate, when it is not the host dialled."""
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def _read(path: str, setting: str, pem_kind: str) -> bytes:
    """The file's bytes; ValueError naming the setting when it cannot be read or holds no PEM block of the kind
    (gRPC's own error for a bad file comes later, at the first call, and names no setting)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{_PREFIX}_{setting}={path!r} cannot be read: {e.strerror or e}") from e
    if b"-----BEGIN " not in data or pem_kind.encode() not in data:
        raise ValueError(f"{_PREFIX}_{setting}={path!r} holds no PEM {pem_kind.lower()}")
    return data
