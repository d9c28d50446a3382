"""An OpenAI-compatible proxy for disaggregated serving: prefill on one engine, decode on another.

For each ``/v1/completions`` request (streamed or not) the proxy sends it to a
prefill engine with ``max_tokens`` 1 and ``kv_transfer_params``
``{"do_remote_decode": true}`` (plus any hints the client put in its own
``kv_transfer_params``, e.g. ``{"verify": true}``), then sends the original
request to a decode engine with the ``kv_transfer_params`` the prefill answer
carried, and returns the decode engine's answer. That is vLLM's NixlConnector
convention, so any connector that follows it works behind this proxy, and this
connector works behind other proxies. Engines are picked round robin. An
``X-Request-Id`` header is passed to both engines.

Engines and the proxy itself are addressed by URL (``http://host:port``) or by
unix socket (``unix:/path``), which is what the tests use.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

#: Request fields that make no sense for the one-token prefill request.
NOT_FOR_PREFILL = ("stream", "stream_options", "min_tokens", "logprobs", "echo", "n", "best_of")


@dataclass(frozen=True)
class Engine:
    """One vLLM OpenAI server: a client that reaches it, and how to name it in errors."""

    name: str
    client: httpx.AsyncClient


#: Idle connections to engines are dropped after this long: well before vLLM's own
#: keep-alive timeout (5 s), so the proxy never sends on a connection the engine is closing.
KEEPALIVE_S = 2.0


def engine(address: str, timeout_s: float) -> Engine:
    """A client of the server at ``http://host:port`` or ``unix:/path``."""
    uds = address.removeprefix("unix:") if address.startswith("unix:") else None
    transport = httpx.AsyncHTTPTransport(uds=uds, limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S))
    base_url = "http://engine" if uds else address
    return Engine(address, httpx.AsyncClient(transport=transport, base_url=base_url,
                                             timeout=timeout_s))


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "kvxfer_proxy_error",
                                   "code": status}}, status_code=status)


def create_app(prefill: list[str], decode: list[str], timeout_s: float = 600.0) -> FastAPI:
    """The proxy's ASGI app, over the given prefill and decode engines."""
    if not prefill or not decode:
        raise ValueError("the proxy needs at least one prefill and one decode engine")
    prefills = [engine(a, timeout_s) for a in prefill]
    decodes = [engine(a, timeout_s) for a in decode]
    next_prefill: Iterator[Engine] = itertools.cycle(prefills)
    next_decode: Iterator[Engine] = itertools.cycle(decodes)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        for e in prefills + decodes:
            await e.client.aclose()

    app = FastAPI(title="kvxfer disaggregating proxy", lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body: dict[str, Any] = await request.json()
        headers = {k: v for k, v in request.headers.items() if k.lower() == "x-request-id"}
        hints = body.pop("kv_transfer_params", None) or {}
        first = {k: v for k, v in body.items() if k not in NOT_FOR_PREFILL}
        first.update(max_tokens=1, kv_transfer_params={**hints, "do_remote_decode": True})
        pre = next(next_prefill)
        try:
            reply = await pre.client.post("/v1/completions", json=first, headers=headers)
        except httpx.HTTPError as exc:
            return _error(502, f"prefill engine {pre.name} unreachable: {exc!r}")
        if reply.status_code != 200:
            return Response(reply.content, reply.status_code, media_type="application/json")
        params = reply.json().get("kv_transfer_params")
        second = {**body, "kv_transfer_params": params}
        dec = next(next_decode)
        try:
            if body.get("stream"):
                upstream = await dec.client.send(
                    dec.client.build_request("POST", "/v1/completions", json=second,
                                             headers=headers), stream=True)
                return StreamingResponse(upstream.aiter_raw(), status_code=upstream.status_code,
                                         media_type="text/event-stream",
                                         background=BackgroundTask(upstream.aclose))
            answer = await dec.client.post("/v1/completions", json=second, headers=headers)
        except httpx.HTTPError as exc:
            return _error(502, f"decode engine {dec.name} unreachable: {exc!r}")
        return Response(answer.content, answer.status_code, media_type="application/json")

    @app.get("/v1/models")
    async def models() -> Response:
        dec = next(next_decode)
        try:
            answer = await dec.client.get("/v1/models")
        except httpx.HTTPError as exc:
            return _error(502, f"decode engine {dec.name} unreachable: {exc!r}")
        return Response(answer.content, answer.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        down = []
        for e in prefills + decodes:
            try:
                if (await e.client.get("/health")).status_code != 200:
                    down.append(e.name)
            except httpx.HTTPError:
                down.append(e.name)
        if down:
            return _error(503, f"engines not healthy: {down}")
        return JSONResponse({"status": "ok", "prefill": prefill, "decode": decode})

    return app


def main(argv: list[str] | None = None) -> None:
    """``python -m kvxfer.client.integrations.vllm.proxy --prefill URL --decode URL``."""
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", action="append", required=True,
                        help="a prefill engine: http://host:port or unix:/path (repeatable)")
    parser.add_argument("--decode", action="append", required=True,
                        help="a decode engine: http://host:port or unix:/path (repeatable)")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to serve on (default 8000)")
    parser.add_argument("--uds", help="serve on this unix socket instead of host:port")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per engine call")
    args = parser.parse_args(argv)
    app = create_app(args.prefill, args.decode, args.timeout)
    print(json.dumps({"proxy": f"unix:{args.uds}" if args.uds else f"http://{args.host}:{args.port}",
                      "prefill": args.prefill, "decode": args.decode}), flush=True)
    uvicorn.run(app, host=args.host, port=args.port, uds=args.uds, log_level="warning")


if __name__ == "__main__":
    main()
