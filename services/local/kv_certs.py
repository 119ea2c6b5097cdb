"""Certificates for `pdserve up --kv-tls`: mutual TLS on the KV transfer gRPC of a local stack.

`generate` makes, with the `openssl` command, a throwaway CA and one certificate + key that every prefill and
decode worker of the stack presents (docs/security.md, "Turning TLS on"): extended key usage serverAuth and
clientAuth (a prefill worker serves with it, a decode worker pulls with it), subjectAltName naming every host
a decode worker may dial (`dialled_hosts`: 127.0.0.1 and localhost, and the transfer host or advertised host
when the workers are told one). The `cryptography` package is not a dependency, so openssl it is; a machine
without it gets an error saying what to install, or which files to pass instead.

Shape of the directory (mode 0700, inside the stack's run directory):
    ca.pem    the CA's certificate: PDSERVE_KV_TLS_CA
    cert.pem  the workers' certificate, signed by the CA: PDSERVE_KV_TLS_CERT
    key.pem   its key, mode 0600 from the moment it exists (written by us, never by openssl): PDSERVE_KV_TLS_KEY
The CA's key lives only while the certificate is signed, then is deleted: nothing left on disk can sign
another certificate this stack would trust. The rest stays with the run directory (the logs), as it does.

`KvTlsFiles.given` takes the user's own three files instead (`--kv-tls-ca/-cert/-key`), checked up front so a
typo is an error at once, naming the flag, not a worker that keeps failing to start.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import secrets
import shutil
import socket
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

KV_TLS_DIR = "kv-tls"  # under the stack's run directory
CA_FILE, CERT_FILE, KEY_FILE = "ca.pem", "cert.pem", "key.pem"
VALID_DAYS = 365
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")  # as the transfer server reads them (it then advertises its name)
_DNS_NAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$"
)

_OPENSSL_HINT = (
    "pdserve up --kv-tls makes its KV transfer certificates with the `openssl` command, which is not on PATH: "
    "install OpenSSL (e.g. `apt-get install openssl`, `dnf install openssl`, `apk add openssl`, "
    "`brew install openssl`), or pass your own files with --kv-tls-ca, --kv-tls-cert and --kv-tls-key "
    '(docs/security.md, "Turning TLS on", shows how to make them)'
)


class OpensslMissing(FileNotFoundError):
    """No `openssl` command to generate certificates with (the message says what to do)."""


class KvCertError(RuntimeError):
    """openssl refused a step of the generation (its own words included)."""


@dataclass(frozen=True)
class KvTlsFiles:
    """The three files every prefill and decode worker of a stack gets (absolute paths)."""

    ca: str
    cert: str
    key: str

    def env(self) -> dict[str, str]:
        """The worker settings that turn KV transfer TLS on with these files."""
        return {"PDSERVE_KV_TLS_CA": self.ca, "PDSERVE_KV_TLS_CERT": self.cert, "PDSERVE_KV_TLS_KEY": self.key}

    @classmethod
    def given(cls, ca: str | None, cert: str | None, key: str | None) -> KvTlsFiles | None:
        """The user's files from --kv-tls-ca/-cert/-key: None when none is given; ValueError naming the flags
        when only some are, or naming the flag whose file cannot be read or holds no PEM of its kind."""
        flags = {"--kv-tls-ca": ca, "--kv-tls-cert": cert, "--kv-tls-key": key}
        if not any(flags.values()):
            return None
        missing = [flag for flag, path in flags.items() if not path]
        if missing:
            given = [flag for flag, path in flags.items() if path]
            raise ValueError(f"{', '.join(given)} given without {', '.join(missing)}: pass all three files, "
                             "or none (then --kv-tls generates them)")  # fmt: skip
        assert ca and cert and key
        for flag, path, kind in (("--kv-tls-ca", ca, "CERTIFICATE"), ("--kv-tls-cert", cert, "CERTIFICATE"),
                                 ("--kv-tls-key", key, "PRIVATE KEY")):  # fmt: skip
            _check_pem(flag, path, kind)
        return cls(*(str(Path(p).resolve()) for p in (ca, cert, key)))


def _check_pem(flag: str, path: str, kind: str) -> None:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot be read ({e.strerror or e})") from e
    if b"-----BEGIN " not in data or kind.encode() not in data:
        raise ValueError(f"{flag} {path}: holds no PEM {kind.lower()}")


def find_openssl() -> str:
    """The `openssl` command's path; OpensslMissing (what to install, or which files to pass) when there is none."""
    found = shutil.which("openssl")
    if found is None:
        raise OpensslMissing(_OPENSSL_HINT)
    return found


_USERS_OWN = ("PDSERVE_KV_TLS_SERVER_NAME", "--kv-tls-server-name")  # the name decode workers expect


def _set_by_the_stack(name: str, own_files: bool) -> bool:
    """Whether a variable (PDSERVE_KV_TLS_*) or worker flag (--kv-tls-*) is one a stack with KV TLS sets on
    its workers itself: the CA, certificate and key; the server name too with generated files (they name
    every host dialled), but not with the user's own (which may need a name of the user's choosing)."""
    if not name.startswith(("PDSERVE_KV_TLS_", "--kv-tls-")):
        return False
    return not (own_files and name.startswith(_USERS_OWN))


def refuse_other_kv_tls(env: Mapping[str, str], flags: Sequence[str], own_files: bool) -> None:
    """The stack's KV TLS settings given another way too — in its variables (`env`), which it would drop, or
    in the worker flags, which would silently win — are a ValueError naming them."""
    given = sorted(k for k in env if _set_by_the_stack(k, own_files))
    given += sorted({f.split("=")[0] for f in flags if _set_by_the_stack(f, own_files)})
    if given:
        raise ValueError(f"--kv-tls sets the workers' KV TLS files itself: drop {', '.join(given)}")


def without_kv_tls(env: Mapping[str, str], own_files: bool) -> dict[str, str]:
    """`env` less the KV TLS settings the stack sets itself (inherited ones were meant for something else)."""
    return {k: v for k, v in env.items() if not _set_by_the_stack(k, own_files)}


def _flag_value(flags: Sequence[str], name: str) -> str | None:
    """The last value of `--name X` or `--name=X` in `flags` (argparse keeps the last), else None."""
    value = None
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif flag.startswith(name + "="):
            value = flag[len(name) + 1 :]
    return value


def dialled_hosts(env: Mapping[str, str], flags: Sequence[str] = ()) -> list[str]:
    """Every name a decode worker may dial a prefill worker of the stack at, which its certificate must carry:
    127.0.0.1 and localhost; the transfer server's host (`rpc_host`) and advertised host (`advertise_host`)
    as the prefill workers get them (PDSERVE_RPC_HOST / PDSERVE_ADVERTISE_HOST in `env`, or --rpc-host /
    --advertise-host in `flags`, which win as on the worker's command line); and this machine's name when
    the server binds a wildcard address with no advertised host (it advertises that name then)."""
    rpc_host = _flag_value(flags, "--rpc-host") or env.get("PDSERVE_RPC_HOST") or "127.0.0.1"
    advertised = _flag_value(flags, "--advertise-host") or env.get("PDSERVE_ADVERTISE_HOST")
    hosts = ["127.0.0.1", "localhost"]
    if advertised:
        hosts.append(advertised)
    if rpc_host in WILDCARD_HOSTS:
        if not advertised:
            hosts.append(socket.getfqdn())
    else:
        hosts.append(rpc_host)
    return list(dict.fromkeys(h.strip("[]") for h in hosts))


def _subject_alt_names(hosts: Iterable[str]) -> list[str]:
    """openssl configuration lines naming each host: an IP entry for an address, a DNS entry for a name."""
    lines: list[str] = []
    ips = dns = 0
    for host in hosts:
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            if not _DNS_NAME.match(host):
                raise ValueError(f"{host!r} is neither an IP address nor a host name a certificate can carry") from None
            dns += 1
            lines.append(f"DNS.{dns} = {host}")
        else:
            ips += 1
            lines.append(f"IP.{ips} = {address}")
    return lines


def _config(hosts: Iterable[str]) -> str:
    """A self-contained openssl configuration (the system's openssl.cnf is neither needed nor read)."""
    return "\n".join([
        "[req]", "distinguished_name = dn", "prompt = no", "[dn]", "CN = pdserve KV transfer",
        "[ca_ext]", "basicConstraints = critical, CA:TRUE, pathlen:0", "keyUsage = critical, keyCertSign, cRLSign",
        "subjectKeyIdentifier = hash",
        "[leaf_ext]", "basicConstraints = critical, CA:FALSE", "keyUsage = critical, digitalSignature",
        "extendedKeyUsage = serverAuth, clientAuth", "subjectAltName = @alt", "subjectKeyIdentifier = hash",
        "authorityKeyIdentifier = keyid, issuer",
        "[alt]", *_subject_alt_names(hosts), "",
    ])  # fmt: skip


def _write_private(path: Path, data: bytes) -> None:
    """`data` in a new file that is mode 0600 from its creation (an old file of that name is replaced)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _run(openssl: str, step: str, args: list[str], stdin: bytes | None = None) -> bytes:
    done = subprocess.run([openssl, *args], input=stdin, capture_output=True, timeout=60, check=False)
    if done.returncode != 0:
        words = done.stderr.decode(errors="replace").strip().splitlines()[-3:]
        raise KvCertError(f"openssl could not {step} (exit code {done.returncode}): {' | '.join(words)}")
    return done.stdout


def _new_key(openssl: str) -> bytes:
    """A P-256 private key (PKCS#8 PEM) on openssl's standard output: it never sits in a file we did not make."""
    return _run(openssl, "make a key", ["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256"])


def _serial() -> str:
    return f"0x{secrets.randbits(127) | 1:x}"  # positive, unpredictable, never 0


def generate(directory: Path, hosts: Iterable[str], days: int = VALID_DAYS) -> KvTlsFiles:
    """A fresh CA and one certificate for every worker, in `directory` (made mode 0700; files of an earlier
    run there are replaced): see the module docstring. Raises OpensslMissing, KvCertError, or ValueError for
    a host no certificate can name."""
    openssl = find_openssl()
    config_text = _config(hosts)  # bad hosts fail before anything is written
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)  # an existing directory too: the key and, for a moment, the CA's key live here
    ca, cert, key = directory / CA_FILE, directory / CERT_FILE, directory / KEY_FILE
    ca_key, config = directory / "ca-key.pem", directory / "openssl.cnf"
    try:
        config.write_text(config_text)
        _write_private(ca_key, _new_key(openssl))
        common = ["-config", str(config), "-sha256", "-days", str(days)]
        _run(openssl, "make the CA", ["req", "-x509", "-new", "-key", str(ca_key), *common, "-extensions", "ca_ext",
             "-subj", "/CN=pdserve KV transfer CA", "-set_serial", _serial(), "-out", str(ca)])  # fmt: skip
        _write_private(key, _new_key(openssl))
        csr = ["req", "-new", "-key", str(key), "-config", str(config), "-subj", "/CN=pdserve KV worker"]
        request = _run(openssl, "make the certificate request", csr)
        _run(openssl, "sign the certificate", ["x509", "-req", "-CA", str(ca), "-CAkey", str(ca_key), *common[2:],
             "-extfile", str(config), "-extensions", "leaf_ext", "-set_serial", _serial(), "-out", str(cert)],
             stdin=request)  # fmt: skip
    finally:  # whatever happened: no CA key (nothing can sign more), no stray configuration
        for path in (ca_key, config):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    return KvTlsFiles(str(ca.resolve()), str(cert.resolve()), str(key.resolve()))
