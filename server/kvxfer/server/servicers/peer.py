"""The peer API (``kvxfer.v1.KvxferPeer``): sessions, liveness, and the transfer rendezvous.

Every call is made by a ``Caller`` (its certificate names under mutual TLS), and
every action that opens a session or touches a transfer leaves one audit line
(``kvxfer.server.audit``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import grpc

from kvxfer.server.audit import audited
from kvxfer.server.peer_protocol import (
    abort_from_proto,
    claim_from_proto,
    commit_from_proto,
    grant_to_proto,
    hello_from_request,
    hello_to_response,
    pull_ask_from_proto,
    started_to_proto,
)
from kvxfer.server.sessions import Sessions
from kvxfer.server.tls import Caller
from kvxfer.server.transfers.coordinator import TransferCoordinator
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.v1 import kvxfer_pb2_grpc as pb_grpc
from kvxfer.wire.codec import holds_from_proto, info_to_proto

Context = grpc.aio.ServicerContext[Any, Any]


def _audited(caller: Caller, action: str, transfer_id: str, session_id: str) -> ContextManager[None]:
    return audited(f"peer={caller.name!r}", action, transfer_id, session_id)


class PeerService(pb_grpc.KvxferPeerServicer):
    """The API other kvxfer daemons call."""

    def __init__(self, sessions: Sessions, transfers: TransferCoordinator) -> None:
        self._sessions = sessions
        self._transfers = transfers

    async def Handshake(self, request: pb.HandshakeRequest, context: Context) -> pb.HandshakeResponse:
        caller = Caller.of(context)
        with _audited(caller, "handshake", "", request.session_id):
            return hello_to_response(await self._sessions.accept(hello_from_request(request), caller))

    async def Watch(self, requests: AsyncIterator[pb.WatchRequest],
                    context: Context) -> AsyncIterator[pb.Heartbeat]:
        first = await anext(aiter(requests), None)
        if first is None:
            return  # the sender hung up before naming its session
        beats = self._sessions.heartbeats(first.session_id, Caller.of(context), requests)
        session_id = first.session_id

        def stream_ended(_: Context) -> None:
            # However the stream ends, the session ends with it: a stream whose sender died
            # while a heartbeat was being written leaves ``beats`` suspended, not closed.
            self._sessions.watch_ended(session_id, "its Watch stream ended")

        context.add_done_callback(stream_ended)  # type: ignore[arg-type]  # the stub wants its own class
        async for unix_time in beats:
            yield pb.Heartbeat(unix_time=unix_time)

    async def Claim(self, request: pb.ClaimRequest, context: Context) -> pb.ClaimResponse:
        caller = Caller.of(context)
        with _audited(caller, "claim", request.transfer_id, request.session_id):
            claim = claim_from_proto(request)
            grant = await self._transfers.claim(claim, caller)
        return grant_to_proto(grant)

    async def Commit(self, request: pb.CommitRequest, context: Context) -> pb.TransferStatus:
        caller = Caller.of(context)
        with _audited(caller, "commit", request.transfer_id, request.session_id):
            info = await self._transfers.commit(commit_from_proto(request), caller)
        return info_to_proto(info)

    async def RequestPush(self, request: pb.RequestPushRequest,
                          context: Context) -> pb.RequestPushResponse:
        caller = Caller.of(context)
        with _audited(caller, "request-push", request.transfer_id, ""):
            push = pull_ask_from_proto(request)
            return started_to_proto(self._transfers.request_push(push, caller))

    async def AbortTransfer(self, request: pb.AbortTransferRequest,
                            context: Context) -> pb.AbortTransferResponse:
        caller = Caller.of(context)
        with _audited(caller, "abort", request.transfer_id, request.session_id):
            self._transfers.abort_from_peer(abort_from_proto(request), caller)
        return pb.AbortTransferResponse()

    async def KeepOffers(self, request: pb.PeerKeepOffersRequest,
                         context: Context) -> pb.KeepOffersResponse:
        caller = Caller.of(context)
        holds = holds_from_proto(request.offers)
        with _audited(caller, "keep-offers", ",".join(h.transfer_id for h in holds), ""):
            remaining = self._transfers.offers.keep(holds, request.keep_s, caller)
        return pb.KeepOffersResponse(remaining_s=remaining)
