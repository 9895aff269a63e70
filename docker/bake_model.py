"""Convert the default model into HISERVE_CACHE_DIR at image build time.

    TORCH_DEVICE_BACKEND_AUTOLOAD=0 python bake_model.py

The conversion goes through transformers, which imports torch, and accelerate, which
imports torch_musa whenever the package is installed. torch_musa needs the MUSA driver
libraries, which exist only in a container started with the mthreads runtime and never
during ``docker build``; the converted weights do not depend on it. So this process
turns torch's backend autoload off and hides torch_musa before anything imports it.
"""

from __future__ import annotations

import os
import sys

# NOTE: both before the first `import torch`: autoload is read once, at that import.
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
# A None entry makes `import torch_musa` fail and importlib.util.find_spec return None,
# so libraries that probe for it (accelerate) see it as absent.
sys.modules["torch_musa"] = None  # type: ignore[assignment]


def main() -> int:
    from engine.loader import resolve_model_path

    # Both layouts: the full float32 one (GPUs, --dtype float32) and the packed one that
    # --dtype auto serves on a CPU (its norms and first columns only, about 1 MB), so no
    # container converts at start.
    print(f"default model ready at {resolve_model_path('default')}")
    print(f"packed layout ready at {resolve_model_path('default', packed=True)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
