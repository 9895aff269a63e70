"""``python -m server`` with the no-work model of ``bench.micro.host_step``: a server
whose steps are host work only, as a GPU's host would spend them.

    python -m bench.micro.no_work_server [server flags]

Every ``Engine`` the process builds has its forward and LM head replaced by constant
results (``NoWorkModel``) once it is built, so its start-up checks still ran on the real
model. Tokens/s through it say how fast the host alone (scheduling, landing the tokens,
the HTTP side) can serve; ``python -m bench.http_cost --no-work-model`` compares it with
the same engine offline. For benchmarks only: its text is random tokens.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from bench.micro.host_step import NoWorkModel
from engine.engine import Engine


def patch_engine() -> None:
    """Make every Engine built from now on run the no-work model, on one torch thread
    (a GPU host runs no CPU kernels; idle OpenMP workers spinning after each small op
    would take a core from the HTTP side on a small box)."""
    torch.set_num_threads(1)
    built = Engine.__init__

    def init(self: Engine, *args: Any, **kwargs: Any) -> None:
        built(self, *args, **kwargs)
        self.runner.model = NoWorkModel(self.runner.model)

    Engine.__init__ = init  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    from server.__main__ import main as serve

    patch_engine()
    return serve(argv)


if __name__ == "__mp_main__":
    # NOTE: the engine's own process (``--engine-process``) is spawned, and imports this
    # module under this name before it builds its engine: patched there too.
    patch_engine()

if __name__ == "__main__":
    sys.exit(main())
