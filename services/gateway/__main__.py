"""`python -m services.gateway`: serve the gateway with settings from PDSERVE_* variables."""

from __future__ import annotations

import logging

import uvicorn

from services.gateway.app import create_app
from shared.settings import GatewaySettings, from_env


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = from_env(GatewaySettings)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info")


if __name__ == "__main__":
    main()
