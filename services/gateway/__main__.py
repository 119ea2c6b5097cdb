"""`python -m services.gateway [flags]`: the same as `pdserve gateway [flags]` (settings from PDSERVE_* variables,
SIGTERM drains)."""

from __future__ import annotations

import sys

from services.cli import main

if __name__ == "__main__":
    sys.exit(main(["gateway", *sys.argv[1:]]))
