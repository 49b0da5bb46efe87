"""The floor of an upstream worker's CPU: the HTTP exchange alone, as a process of its own.

``python -m bench._http_floor --port P --rate R --seconds S`` sends the upstream the
requests the openai engine sends it (``/v1/completions``, streamed with usage, max_tokens
16), open loop at ``--rate`` with aiohttp (the engine's client), reads every SSE line and
parses its JSON as the engine must, and prints one line: its CPU-milliseconds per answered
request (``time.process_time``, start-up excluded) and how many were answered.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import aiohttp
import orjson
import uvloop

from bench._open_loop import open_loop

MAX_TOKENS = 16


async def _drive(port: int, rate: float, seconds: float) -> int:
    url = f"http://127.0.0.1:{port}/v1/completions"
    answered = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def one(i: int) -> None:
            nonlocal answered
            body = {
                "model": "up",
                "prompt": f"def f{i}(x):\n    return",
                "max_tokens": MAX_TOKENS,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with http.post(url, data=orjson.dumps(body)) as response:
                async for line in response.content:
                    if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                        orjson.loads(line[6:])
            answered += response.status == 200

        total = int(rate * seconds)
        await asyncio.gather(*[asyncio.create_task(one(i)) async for i in open_loop(rate, total)])
    return answered


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench._http_floor", description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--rate", type=float, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    args = parser.parse_args()
    started = time.process_time()
    answered = uvloop.run(_drive(args.port, args.rate, args.seconds))
    cpu_ms = 1000 * (time.process_time() - started)
    print(f"{cpu_ms / max(1, answered):.3f} {answered}")


if __name__ == "__main__":
    main()
