"""Container health check: exit 0 when the server's /health answers 200, else 1.

Stdlib only, so the images need no curl. Reads the port from HISERVE_PORT (default
8000) and sends HISERVE_API_KEY as a bearer token when one is set.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    port = os.environ.get("HISERVE_PORT", "").strip() or "8000"
    request = urllib.request.Request(f"http://127.0.0.1:{port}/health")
    api_key = os.environ.get("HISERVE_API_KEY", "").strip()
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            status = response.status
    except urllib.error.HTTPError as exc:  # 503 while the model loads
        status = exc.code
    except (OSError, ValueError) as exc:
        print(f"health check: {exc}", file=sys.stderr)
        return 1
    print(f"health check: HTTP {status}")
    return 0 if status == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
