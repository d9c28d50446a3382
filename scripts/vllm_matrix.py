"""The support matrix of the vLLM connector, with real engines: every pair of block sizes,
and tensor-parallel sizes that differ. Run it before changing what the matrix says
(docs/how-to/vllm.md#support-matrix); it takes 10-15 minutes on 2 cores.

usage: .venv-vllm/bin/python scripts/vllm_matrix.py WORKDIR [--blocks 32,64,128] [--page 32]
                                                   [--tp2]

One engine per block size (``kv_both``, each with its own daemon; every pool keeps pages of
``--page`` tokens, head-major), and a plain engine (block 32, no connector). For every
ordered pair of engines, a prompt is prefilled on the first and decoded on the second with
the first's ``kv_transfer_params``; its answer must be the plain engine's, token for token
and logprob for logprob, with the prompt's tokens taken from the transfer. ``--tp2`` adds
an engine of two tensor-parallel ranks (block 32), and every pool then keeps pages of one
KV head: TP 2 -> 1 and 1 -> 2 must load every prompt token, with the decode engine's own
plain tokens and logprobs within ``MIXED_TP_LOGPROB`` of its (KV computed on two ranks
differs from KV computed on one in the last bits). Prints one line per pair and exits 1
if any pair did not do what the matrix says.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from kvxfer.client.integrations.vllm.deploy import (
    VllmServer,
    connector_config,
    engine_block_format,
)
from kvxfer.client.integrations.vllm.layout import model_pool_flag
from kvxfer.client.integrations.vllm.tiny_model import build, prompt
from kvxfer.client.spawn import LocalDaemon, dev_certs

#: Tokens generated per answer; top logprobs compared per token.
NEW_TOKENS, TOP = 8, 3
#: How far a logprob of an engine that loaded KV of another TP size may be from its plain one's.
MIXED_TP_LOGPROB = 1e-2
SOURCE = 'vllm:prompt_tokens_by_source_total{engine="0",model_name="%s",source="%s"}'


def ask(engine: VllmServer, model: str, text: str, params: dict[str, Any] | None,
        max_tokens: int = NEW_TOKENS, salt: str | None = None) -> dict[str, Any]:
    """One completion of ``engine``: its JSON answer (``salt``: a ``cache_salt``, so that
    it neither hits nor fills the prefix cache other requests use)."""
    body: dict[str, Any] = {"model": model, "prompt": text, "max_tokens": max_tokens,
                            "temperature": 0, "logprobs": TOP}
    if params is not None:
        body["kv_transfer_params"] = params
    if salt is not None:
        body["cache_salt"] = salt
    with engine.client() as http:
        reply = http.post("/v1/completions", json=body)
        reply.raise_for_status()
        answer: dict[str, Any] = reply.json()
        return answer


def distance(want: dict[str, Any], got: dict[str, Any]) -> float:
    """How far two answers are: infinite for other tokens, else the largest logprob gap."""
    w, g = want["choices"][0]["logprobs"], got["choices"][0]["logprobs"]
    if w["tokens"] != g["tokens"]:
        return float("inf")
    return max(abs(a - b) for a, b in zip(w["token_logprobs"], g["token_logprobs"], strict=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--blocks", default="32,64,128",
                        help="the engines' block sizes (default: 32,64,128; vLLM 0.32's CPU "
                             "build refuses 16 at start)")
    parser.add_argument("--page", type=int, default=32, help="every pool's page_size")
    parser.add_argument("--tp2", action="store_true", help="add a TP 2 engine (block 32)")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = str(build(str(args.workdir / "model")))
    engines: dict[str, tuple[int, int]] = {f"b{b}": (int(b), 1) for b in args.blocks.split(",")}
    if args.tp2:
        engines["tp2"] = (32, 2)
    failures = 0
    with ExitStack() as stack:
        tls = stack.enter_context(dev_certs(*(f"{name}-daemon" for name in engines)))
        plain = VllmServer("plain", model, args.workdir)
        stack.callback(plain.stop)
        started = {"plain": plain.spawn()}
        heads = {"page_heads": 1} if args.tp2 else {}
        for name, (block, tp) in engines.items():
            pool = model_pool_flag(model, "kv", block, 512, tp=tp, page_size=args.page,
                                   block_format=engine_block_format(model, block), **heads)
            daemon = stack.enter_context(LocalDaemon(
                f"{name}-daemon", [pool], workdir=str(args.workdir / name), tls=tls,
                extra_args=["--dial-allow", "127.0.0.1/32"]))
            engine = VllmServer(name, model, args.workdir, block_size=block, tp=tp,
                                kv_transfer=connector_config("kv_both", daemon.worker_address,
                                                             page_size=args.page, **heads))
            stack.callback(engine.stop)
            started[name] = engine.spawn()
        running: dict[str, VllmServer] = {}
        for name, engine in started.items():  # all start at once: imports dominate
            try:
                engine.wait_ready(timeout_s=600)
                running[name] = engine
            except (RuntimeError, TimeoutError) as exc:
                print(f"{name}: does not start: {str(exc).strip().splitlines()[-1][:300]}",
                      flush=True)
                failures += 1
        if "plain" not in running:
            return 1
        plain = running.pop("plain")
        for n, (first, second) in enumerate(itertools.permutations(running, 2)):
            text = prompt(seed=500 + n, words=70 + 7 * n)
            mixed = engines[first][1] != engines[second][1]
            # The decode engine of another TP size than the plain engine's is compared with
            # its own plain answer (its logprobs differ from the plain engine's in the last bits).
            want = (ask(running[second], model, text, None, salt="plain")
                    if engines[second][1] != 1 or mixed else ask(plain, model, text, None))
            try:
                params = ask(running[first], model, text, {"do_remote_decode": True},
                             max_tokens=1)["kv_transfer_params"]
                before = running[second].metric(SOURCE % (model, "external_kv_transfer"))
                got = ask(running[second], model, text, params)
                loaded = running[second].metric(SOURCE % (model, "external_kv_transfer")) - before
            except httpx.HTTPError as exc:
                print(f"{first} -> {second}: FAILED: {exc}", flush=True)
                failures += 1
                continue
            tokens = got["usage"]["prompt_tokens"]
            gap = distance(want, got)
            close = gap <= (MIXED_TP_LOGPROB if mixed else 0.0)
            ok = close and loaded == tokens
            failures += not ok
            what = f"loaded {loaded:.0f} of {tokens}"
            print(f"{first} -> {second}: {what}; answer {'=' if gap == 0 else '~' if close else '!='}"
                  f" plain (largest logprob gap {gap:.3g}): {'ok' if ok else 'FAILED'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
