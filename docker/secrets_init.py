#!/usr/bin/env python3
"""One-shot `secrets-init` service (installed in the image as `pdserve-secrets-init`): the deployment's
secrets, one file each in a directory (the compose volume `secrets`, mounted at /run/secrets):

    api_keys         the gateway's accepted API key(s), comma-separated   (gateway: PDSERVE_API_KEYS_FILE)
    cluster_secret   signs KV pull tickets between workers               (workers: PDSERVE_CLUSTER_SECRET_FILE)
    nats_password    NATS user `pdserve`'s password                       (nats; every service)
    redis_password   Redis's requirepass                                  (redis; every service)

Each file is written only when missing or empty, so restarts keep what clients already use; a value given in
this process's environment (PDSERVE_API_KEYS, PDSERVE_CLUSTER_SECRET, PDSERVE_NATS_PASSWORD,
PDSERVE_REDIS_PASSWORD: the user's shell or .env) wins and replaces the file. Files are mode 0600, the
directory 0700. Nothing secret is printed: read a value with `cat` inside a container that mounts it.

    pdserve-secrets-init [DIRECTORY]     (default /run/secrets)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
from pathlib import Path

DEFAULT_DIR = "/run/secrets"
# file name → how to make a fresh value
SECRETS = {
    "api_keys": lambda: "pd-" + secrets.token_urlsafe(32),
    "cluster_secret": lambda: secrets.token_urlsafe(48),
    "nats_password": lambda: secrets.token_urlsafe(32),
    "redis_password": lambda: secrets.token_urlsafe(32),
}
# Characters a password may not hold: compose's nats and redis commands put it between double quotes (in
# nats-server's environment, in redis-server's configuration), so no quote or backslash; white space, `$`
# and the configuration languages' separators stay out too.
UNSAFE = set("\"'\\$` \t\r\n#;,{}[]")


def ensure(directory: Path, name: str, supplied: str | None) -> str:
    """Make `directory/name` hold a secret: `supplied` when given, else what is there, else a fresh one.
    Returns what happened, for the log."""
    path = directory / name
    current = path.read_text().strip() if path.is_file() else ""
    if supplied:
        if name != "api_keys" and (bad := sorted(set(supplied) & UNSAFE)):
            raise ValueError(f"PDSERVE_{name.upper()} contains {''.join(bad)!r}: use letters, digits, - and _")
        if supplied == current:
            return "kept (the value given in the environment)"
        _write(path, supplied)
        return "set from the environment"
    if current:
        os.chmod(path, 0o600)
        return "kept"
    _write(path, SECRETS[name]())
    return "generated"


def _write(path: Path, value: str) -> None:
    """Atomically, never readable by others, not even for a moment."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    os.chmod(tmp, 0o600)  # O_CREAT's mode does not apply to a file left over from an interrupted run
    os.replace(tmp, path)


def main(argv: list[str], environ: dict[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        print("usage: pdserve-secrets-init [DIRECTORY]", file=sys.stderr)
        return 2
    directory = Path(argv[0] if argv else DEFAULT_DIR)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(PermissionError):  # a directory someone else owns: the files are 0600 anyway
            os.chmod(directory, 0o700)
        for name in SECRETS:
            what = ensure(directory, name, environ.get(f"PDSERVE_{name.upper()}", "").strip() or None)
            print(f"secrets-init: {directory / name}: {what}")
    except (OSError, ValueError) as exc:
        print(f"secrets-init: {exc}", file=sys.stderr)
        return 1
    print(
        f"secrets-init: read the gateway's API key with `docker compose exec -T gateway cat {directory}/api_keys`",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
