#!/usr/bin/env python3
"""The container's health probe: exit 0 when GET /readiness on this container answers 200.

/readiness is 503 until the model is loaded and warmed up and again while draining, so Docker
reports "starting" during start-up and "unhealthy" if the engine stops serving. The appliance
listens on TOKENSPEED_PORT (the image sets 8000); the probe always asks the loopback address.
Standard library only: it runs every few seconds and must start fast.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

TIMEOUT_S = 4.0


def readiness_url(environ: dict[str, str]) -> str:
    port = environ.get("TOKENSPEED_PORT") or "8000"
    return f"http://127.0.0.1:{port}/readiness"


def probe(url: str) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            return response.status == 200, f"{response.status} {response.read(200).decode(errors='replace')}"
    except urllib.error.HTTPError as exc:  # 503 while loading or draining
        return False, f"{exc.code} {exc.read(200).decode(errors='replace')}"
    except (OSError, ValueError) as exc:
        return False, f"no answer: {exc}"


def main() -> int:
    url = readiness_url(dict(os.environ))
    healthy, detail = probe(url)
    print(f"{url}: {detail}")  # Docker keeps this line in the health log (docker inspect)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
