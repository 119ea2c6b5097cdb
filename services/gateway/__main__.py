"""`python -m services.gateway [flags]`: the same as `pdserve gateway [flags]` (settings from PDSERVE_* variables,
SIGTERM drains), without the CLI."""

from __future__ import annotations

import sys

from services.gateway.main import main

if __name__ == "__main__":
    sys.exit(main())
