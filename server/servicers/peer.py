"""The peer API (``kvxfer.v1.KvxferPeer``): sessions, liveness, and the transfer rendezvous."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvxfer.server.peer_protocol import (
    abort_from_proto,
    claim_from_proto,
    commit_from_proto,
    grant_to_proto,
    hello_from_request,
    hello_to_response,
    push_request_from_proto,
)
from kvxfer.server.sessions import Sessions
from kvxfer.server.transfers.coordinator import TransferCoordinator
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.v1 import kvxfer_pb2_grpc as pb_grpc
from kvxfer.wire.codec import info_to_proto

Context = grpc.aio.ServicerContext[Any, Any]


def _wait_s(requested: float, context: Context) -> float:
    """How long a call may wait: what the caller asked for, within its own deadline."""
    left = context.time_remaining()
    if left is None:
        return requested
    return min(requested, left) if requested else left


class PeerService(pb_grpc.KvxferPeerServicer):
    """The API other kvxfer daemons call."""

    def __init__(self, sessions: Sessions, transfers: TransferCoordinator) -> None:
        self._sessions = sessions
        self._transfers = transfers

    async def Handshake(self, request: pb.HandshakeRequest, context: Context) -> pb.HandshakeResponse:
        return hello_to_response(self._sessions.accept(hello_from_request(request)))

    async def Watch(self, request: pb.WatchRequest, context: Context) -> AsyncIterator[pb.Heartbeat]:
        async for unix_time in self._sessions.heartbeats(request.session_id):
            yield pb.Heartbeat(unix_time=unix_time)

    async def Claim(self, request: pb.ClaimRequest, context: Context) -> pb.ClaimResponse:
        claim = claim_from_proto(request)
        return grant_to_proto(await self._transfers.claim(claim, _wait_s(claim.timeout_s, context)))

    async def Commit(self, request: pb.CommitRequest, context: Context) -> pb.TransferStatus:
        return info_to_proto(await self._transfers.commit(commit_from_proto(request)))

    async def RequestPush(self, request: pb.RequestPushRequest,
                          context: Context) -> pb.RequestPushResponse:
        push = push_request_from_proto(request)
        await self._transfers.request_push(push, _wait_s(push.timeout_s, context))
        return pb.RequestPushResponse()

    async def AbortTransfer(self, request: pb.AbortTransferRequest,
                            context: Context) -> pb.AbortTransferResponse:
        self._transfers.abort_from_peer(abort_from_proto(request))
        return pb.AbortTransferResponse()
