"""``python -m server`` / ``hiserve``: parse flags, build the app, serve until SIGTERM."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import math
import signal
import socket
import sys
from collections.abc import Sequence
from typing import Any

import uvicorn

from engine.engine_core import LOG_FORMAT
from engine.heap import freeze_objects
from server.app import create_app
from server.args import ServerArgs, parse_args
from server.connections import ConnectionLimits, guarded_protocol


def uvicorn_config(app: Any, args: ServerArgs) -> uvicorn.Config:
    """uvicorn settings from the server arguments. The HTTP side waits up to the grace
    period for in-flight responses, then cancels them; the lifespan then gives the engine
    the same grace (``AsyncEngine.shutdown``) before it aborts what is left.

    Connections go through ``guarded_protocol`` (caps, header and send deadlines)."""
    limits = ConnectionLimits(
        max_connections=args.max_connections,
        max_connections_per_client=args.max_connections_per_client,
        header_timeout=args.header_timeout,
        send_timeout=args.send_timeout,
        send_buffer_bytes=args.send_buffer_bytes,
    )
    return uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        lifespan="on",
        http=guarded_protocol(limits),
        timeout_graceful_shutdown=math.ceil(args.shutdown_grace),
    )


# After a fatal engine error (a tensor-parallel rank died) the process ends within this
# long, also when a thread is stuck in a collective or in a communicator's teardown.
FATAL_EXIT_S = 20.0


def arm_exit_deadline(seconds: float) -> None:
    """End the process with status 1 in ``seconds`` unless it exits first, after writing
    every thread's stack to stderr (where it was stuck). faulthandler's timer is a C
    thread: a hung call that holds the interpreter does not stop it."""
    faulthandler.dump_traceback_later(seconds, exit=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server; 0 after a drained shutdown (SIGTERM/SIGINT), 1 if the model fails."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    for note in args.notes:
        logging.getLogger("server").info(note)
    exit_code = 0
    server: uvicorn.Server | None = None

    def on_fatal(exc: BaseException) -> None:
        nonlocal exit_code
        exit_code = 1
        # The drain below ends promptly when the engine failed its requests; this bounds
        # it when it cannot (a forward blocked on a dead rank's collective).
        arm_exit_deadline(FATAL_EXIT_S)
        if server is not None:
            server.should_exit = True

    def on_ready() -> None:
        # NOTE: not in create_app itself: an app served in a test's process must not
        # freeze that process's objects (engine/heap.py).
        frozen = freeze_objects()
        logging.getLogger("server").info(
            "%d start-up objects frozen out of the garbage collector's full passes", frozen
        )

    app = create_app(args, on_fatal=on_fatal, on_ready=on_ready)
    server = uvicorn.Server(uvicorn_config(app, args))
    # An inherited socket (--fd) is served as it is: no bind, so no window in which
    # another process could take the port.
    sockets = [socket.socket(fileno=args.fd)] if args.fd is not None else None
    # uvicorn drains on SIGTERM (stop accepting, wait for in-flight responses up to the
    # grace period, then the lifespan shuts the engine down) and afterwards re-raises the
    # signal it caught. Absorb that re-raise, so a drained shutdown exits with status 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    with contextlib.suppress(KeyboardInterrupt):  # SIGINT: uvicorn already drained
        server.run(sockets=sockets)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
