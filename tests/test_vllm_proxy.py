"""The disaggregating proxy against stand-in engines: what it sends where, and its errors.

The stand-ins are small HTTP servers on unix sockets that record each request
and answer as vLLM does; ``test_vllm.py`` runs the proxy in front of real vLLM.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvxfer.client.integrations.vllm.proxy import create_app

REMOTE = {"do_remote_prefill": True, "do_remote_decode": False, "kvxfer": {"transfer_id": "P/r"}}


def stand_in(role: str, seen: list[dict[str, Any]]) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        seen.append({"body": body, "request_id": request.headers.get("x-request-id")})
        if role == "prefill":
            return JSONResponse({"choices": [{"text": " w1"}], "kv_transfer_params": REMOTE})
        if body.get("stream"):
            async def events() -> Any:
                for word in (" w1", " w2"):
                    yield f"data: {json.dumps({'choices': [{'text': word}]})}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse({"choices": [{"text": " w1 w2"}], "got": body["kv_transfer_params"]})

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({})

    return app


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[tuple[str, str, list[dict[str, Any]], list[dict[str, Any]]]]:
    """A stand-in prefill and decode engine on unix sockets, and what each was sent."""
    seen_p: list[dict[str, Any]] = []
    seen_d: list[dict[str, Any]] = []
    servers = []
    for role, seen in (("prefill", seen_p), ("decode", seen_d)):
        socket = tmp_path / f"{role}.sock"
        server = uvicorn.Server(uvicorn.Config(stand_in(role, seen), uds=str(socket), log_level="error"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append((server, thread, socket))
    deadline = time.monotonic() + 10
    while not all(s.started for s, _, _ in servers):
        assert time.monotonic() < deadline, "the stand-in engines did not start"
        time.sleep(0.02)
    yield f"unix:{servers[0][2]}", f"unix:{servers[1][2]}", seen_p, seen_d
    for server, thread, _ in servers:
        server.should_exit = True
        thread.join(10)


async def call(app: FastAPI, method: str, path: str, **kwargs: Any) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as http:
        return await http.request(method, path, **kwargs)


def test_prefill_gets_one_token_and_the_handoff_request_and_decode_gets_its_params(engines) -> None:
    prefill, decode, seen_p, seen_d = engines
    app = create_app([prefill], [decode])
    body = {"model": "m", "prompt": "w5 w6", "max_tokens": 9, "logprobs": 1,
            "kv_transfer_params": {"verify": True}}
    reply = asyncio.run(call(app, "POST", "/v1/completions", json=body,
                             headers={"X-Request-Id": "req-7"}))
    assert reply.status_code == 200 and reply.json()["got"] == REMOTE
    [first] = seen_p
    assert first["body"]["max_tokens"] == 1 and "logprobs" not in first["body"]
    assert first["body"]["kv_transfer_params"] == {"verify": True, "do_remote_decode": True}
    [second] = seen_d
    assert second["body"]["max_tokens"] == 9 and second["body"]["logprobs"] == 1
    assert first["request_id"] == second["request_id"] == "req-7"


def test_a_streamed_request_streams_the_decode_engines_events(engines) -> None:
    prefill, decode, seen_p, seen_d = engines
    app = create_app([prefill], [decode])
    reply = asyncio.run(call(app, "POST", "/v1/completions",
                             json={"model": "m", "prompt": "w5", "max_tokens": 2, "stream": True}))
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
    words = [json.loads(line[6:])["choices"][0]["text"] for line in reply.text.splitlines()
             if line.startswith("data: {")]
    assert words == [" w1", " w2"] and seen_p[0]["body"].get("stream") is None


def test_an_unreachable_engine_is_a_502_that_names_it(engines, tmp_path: Path) -> None:
    prefill, decode, _, _ = engines
    missing = f"unix:{tmp_path / 'nobody.sock'}"
    reply = asyncio.run(call(create_app([missing], [decode]), "POST", "/v1/completions",
                             json={"model": "m", "prompt": "w1", "max_tokens": 1}))
    assert reply.status_code == 502 and f"prefill engine {missing} unreachable" in reply.text
    health = asyncio.run(call(create_app([prefill], [missing]), "GET", "/health"))
    assert health.status_code == 503 and missing in health.text
