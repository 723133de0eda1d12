# SPDX-License-Identifier: Apache-2.0
"""What the engines' kvpush middleware (kvpush.connector.middleware.KvpushErrors) costs a request that succeeds.

Drives the middleware in process, as uvicorn calls it, in front of a
minimal ASGI app that reads the request and answers a completion-sized
JSON body; the same app without the middleware is the baseline. Two
requests: an ordinary completion (a 1,024-token prompt, no kvpush
parameters: it only buffers and replays the body) and a decode leg
(the same with kv_transfer_params: it also parses the JSON and validates
the parameters). Alternates the arms per repeat in one process; prints
the median time per request of each, the middleware's own cost (with
minus without) and the ratio. Failures (a broker lookup) are not timed:
they are not what every request pays.

    python -m bench.middleware_cost [--requests 20000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.middleware import KvpushErrors
from kvpush.dev.localstack.completions import completion_body
from kvpush.dev.localstack.prompts import prompt_token_ids
from kvpush.dev.localstack.transfers import transfer_params

ANSWER = json.dumps({"id": "cmpl-0", "object": "text_completion", "choices": [{"index": 0, "text": "x" * 40, "token_ids": list(range(16)),
                                                                                "finish_reason": "length"}]}).encode()
CONFIG = ConnectorConfig(engine_id="decode-0", role="decode", control_plane="127.0.0.1:1", token="t")


async def app(scope, receive, send):
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json"),
                                                                         (b"content-length", str(len(ANSWER)).encode())]})
    await send({"type": "http.response.body", "body": ANSWER})


async def per_request_s(asgi, body: bytes, requests: int) -> float:
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"content-type", b"application/json")]}

    async def send(message):
        pass

    t0 = time.perf_counter()
    for _ in range(requests):
        sent = False

        async def receive():
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await asgi(scope, receive, send)
    return (time.perf_counter() - t0) / requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    prompt = prompt_token_ids(1024, seed=1)
    bodies = {"ordinary completion": json.dumps(completion_body(prompt, 16)).encode(),
              "decode leg": json.dumps(completion_body(prompt, 16, kv_transfer_params=transfer_params("decode", "xfer-1", "prefill-0"))).encode()}
    arms = {"without": app, "with": KvpushErrors(app, config=CONFIG)}
    print(f"{args.requests} requests x {args.repeats} repeats per arm, alternated; medians per request")
    for name, body in bodies.items():
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        for _ in range(args.repeats):
            for arm, asgi in arms.items():
                times[arm].append(asyncio.run(per_request_s(asgi, body, args.requests)))
        without, with_ = statistics.median(times["without"]), statistics.median(times["with"])
        print(f"{name:20s} ({len(body):5d} B): without {without * 1e6:6.2f} us, with {with_ * 1e6:6.2f} us, "
              f"middleware {(with_ - without) * 1e6:6.2f} us, ratio {with_ / without:.2f}")


if __name__ == "__main__":
    main()
