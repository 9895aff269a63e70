"""What a decode step's outputs cost to cross ``--engine-process``'s pipe: pickled whole
against engine/output_wire.py's form, each side timed on its own.

    python -m bench.micro.output_wire [--batch 64] [--steps 2000] [--rounds 3]

The engine's side is encode + pickle, the server's unpickle + decode (prompts put back,
compact outputs rebuilt); both are per output, in microseconds, the two forms alternated
in each round. The outputs are those of a step in the middle of streamed requests (one
token each, no logprobs): the common case the wire form is for.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler

from engine.kvcache.miss_reasons import MissReasons
from engine.output_wire import OutputDecoder, OutputEncoder
from engine.request import RequestOutput


def step_outputs(batch: int, token: int) -> list[RequestOutput]:
    return [
        RequestOutput(
            request_id=f"cmpl-{i:032x}-0",
            prompt_token_ids=[],
            token_ids=[],
            text="",
            new_token_ids=[token],
            new_text=" word",
            finished=False,
            finish_reason=None,
            cached_tokens=16,
            cached_tokens_device=16,
            cached_tokens_host=0,
            cache_miss_reasons=MissReasons(never_seen=48),
            first_token_time=1000.5,
            arrival_time=1000.0,
        )
        for i in range(batch)
    ]


def whole(batch: int) -> tuple[Callable[[], bytes], Callable[[bytes], object]]:
    prompts = {f"cmpl-{i:032x}-0": [1] * 16 for i in range(batch)}
    outputs = step_outputs(batch, 7)

    def send() -> bytes:
        for out in outputs:
            out.prompt_token_ids = []
        return bytes(ForkingPickler.dumps(("out", outputs, None)))  # as Connection.send

    def receive(data: bytes) -> object:
        got = pickle.loads(data)[1]
        for out in got:
            out.prompt_token_ids = prompts.get(out.request_id) or []
        return got

    return send, receive


def wire(batch: int) -> tuple[Callable[[], bytes], Callable[[bytes], object]]:
    encoder, decoder = OutputEncoder(), OutputDecoder({})
    decoder.decode(encoder.encode(step_outputs(batch, 1)))  # each request's first output
    outputs = step_outputs(batch, 7)

    def send() -> bytes:
        return bytes(ForkingPickler.dumps(("out", encoder.encode(outputs), None)))

    def receive(data: bytes) -> object:
        return decoder.decode(pickle.loads(data)[1])

    return send, receive


def time_sides(
    sides: tuple[Callable[[], bytes], Callable[[bytes], object]], steps: int, batch: int
) -> tuple[float, float, int]:
    send, receive = sides
    data = send()
    start = time.perf_counter()
    for _ in range(steps):
        data = send()
    sent = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        receive(data)
    received = time.perf_counter() - start
    per = 1e6 / (steps * batch)
    return sent * per, received * per, len(data) // batch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    rows: dict[str, list[tuple[float, float, int]]] = {"whole": [], "wire form": []}
    for _ in range(args.rounds):
        rows["whole"].append(time_sides(whole(args.batch), args.steps, args.batch))
        rows["wire form"].append(time_sides(wire(args.batch), args.steps, args.batch))
    print(f"one decode step's outputs across the pipe, batch {args.batch}, us per output")
    print(f"{'':10s} {'engine side':>12s} {'server side':>12s} {'bytes':>6s}")
    for name, results in rows.items():
        engine_us = statistics.median(r[0] for r in results)
        server_us = statistics.median(r[1] for r in results)
        print(f"{name:10s} {engine_us:12.2f} {server_us:12.2f} {results[0][2]:6d}")


if __name__ == "__main__":
    main()
