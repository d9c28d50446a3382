"""The peer protocol's messages as typed values, and their protobuf codec.

Daemons speak ``kvxfer.v1.KvxferPeer`` to each other: a handshake opens a
session (``DaemonHello`` both ways), a ``Claim`` asks the receiver where a
transfer's pages go (``ClaimGrant``), a ``Commit`` closes a verified transfer,
``PullAsk`` starts a pull (with a ``Placement``, without a Claim: the
sender answers ``PushStarted``), and ``PeerAbort`` ends a transfer on the other
side. The peer client and the peer servicer are the only users of the codec;
decoding a request checks its ids, texts and deadlines (``kvxfer.server.limits``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvxfer.descriptor import PoolDescriptor
from kvxfer.errors import InvalidArgumentError, ProtocolVersionError
from kvxfer.local_copy import ArenaFile
from kvxfer.offer_parts import OfferPart
from kvxfer.pages import PageRuns
from kvxfer.server.limits import MIN_CHUNK_BYTES, check_digest, check_id, check_text
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.wire.codec import (
    descriptor_from_proto,
    descriptor_to_proto,
    part_from_proto,
    part_to_proto,
    runs_from_proto,
    runs_to_proto,
)

#: The peer protocol's version: a handshake of another is refused (ProtocolVersionError).
PEER_PROTOCOL_VERSION = 1


def check_version(theirs: int) -> None:
    """Refuse a peer whose protocol version is not ours, naming both."""
    if theirs != PEER_PROTOCOL_VERSION:
        raise ProtocolVersionError(
            f"the peer speaks peer protocol version {theirs or '0 (before versions)'}; this "
            f"daemon speaks version {PEER_PROTOCOL_VERSION}: run the same kvxfer release on both")


@dataclass(frozen=True)
class DaemonHello:
    """What a daemon tells a peer when a session opens: its data plane and its pools.

    ``peer_address`` (where it serves the peer API, for aborts) and ``arena_files``
    (by pool, with local copy on) are sent by the side that opens the session, the
    sender; ``reads_locally`` by the receiver, when it mapped them all.
    """

    session_id: str
    ucx_host: str
    ucx_ports: tuple[int, ...]
    ucx_error_handling: bool
    pools: dict[str, PoolDescriptor]
    peer_address: str = ""
    arena_files: dict[str, ArenaFile] = field(default_factory=dict)
    reads_locally: bool = False


@dataclass(frozen=True)
class Claim:
    """A sender asks where ``transfer_id`` goes (push step 2)."""

    transfer_id: str
    session_id: str
    src_pool: str
    src_runs: PageRuns
    verify: bool
    chunk_bytes: int
    lanes: int
    capability: str = field(default="", repr=False)


@dataclass(frozen=True)
class ClaimGrant:
    """The receiver's answer: tags start at ``tag_base``; chunk ``k`` on lane ``k % lanes``;
    or ``copied``: the receiver already copied every chunk from the sender's arena."""

    tag_base: int
    dst_pool: str
    dst_runs: PageRuns
    lanes: int
    copied: bool = False


@dataclass(frozen=True)
class Commit:
    """A verifying sender sent every chunk; these are their checksums, in order."""

    transfer_id: str
    session_id: str
    checksums: tuple[int, ...]


@dataclass(frozen=True)
class Placement:
    """Where a pull's pages go, so that the sender sends without a Claim: chunk ``k`` to tag
    ``tag_base + k`` on lane ``k % lanes``, in the session ``session_id`` it opened to us."""

    session_id: str
    dst_pool: str
    dst_runs: PageRuns
    tag_base: int
    lanes: int
    chunk_bytes: int

    def grant(self) -> ClaimGrant:
        """The placement as the answer a Claim would have had."""
        return ClaimGrant(self.tag_base, self.dst_pool, self.dst_runs, self.lanes)


@dataclass(frozen=True)
class PushStarted:
    """The sender took a pull's placement and sends: its runs, how many chunks over how many
    lanes, and its verify setting."""

    src_pool: str
    src_runs: PageRuns
    chunks: int
    lanes: int
    verify: bool


@dataclass(frozen=True)
class PullAsk:
    """A puller asks the sender to push ``transfer_id`` (offered here) to ``reply_to``,
    presenting the offer's capability and the prompt digest it expects; with a
    ``placement``, to send without a Claim."""

    transfer_id: str
    reply_to: str
    capability: str = field(default="", repr=False)
    prompt_digest: bytes = b""
    placement: Placement | None = None
    skip_pages: int = 0  # the offer's first pages not to send
    part: OfferPart = field(default_factory=OfferPart)  # which part of the offer


@dataclass(frozen=True)
class PeerAbort:
    """One side ended ``transfer_id``; the other should end it too (before a session claimed
    it, an offer's ``capability`` says the caller may)."""

    transfer_id: str
    session_id: str
    reason: str
    capability: str = field(default="", repr=False)


def hello_to_request(hello: DaemonHello) -> pb.HandshakeRequest:
    """The opening side's hello."""
    return pb.HandshakeRequest(
        session_id=hello.session_id, ucx_host=hello.ucx_host, ucx_port=hello.ucx_ports[0],
        ucx_ports=hello.ucx_ports, ucx_error_handling=hello.ucx_error_handling,
        pools=[descriptor_to_proto(d) for d in hello.pools.values()],
        peer_address=hello.peer_address,
        arena_files=[pb.ArenaFile(pool=pool, path=f.path, size_bytes=f.size_bytes,
                                  boot_id=f.boot_id, device=f.device, inode=f.inode)
                     for pool, f in hello.arena_files.items()],
        protocol_version=PEER_PROTOCOL_VERSION,
    )


def hello_from_request(msg: pb.HandshakeRequest) -> DaemonHello:
    """Decode an opening hello (its version, ids, addresses and descriptors are validated)."""
    check_version(msg.protocol_version)
    return DaemonHello(
        check_id("session_id", msg.session_id), check_text("ucx_host", msg.ucx_host),
        tuple(msg.ucx_ports) or (msg.ucx_port,), msg.ucx_error_handling, _pools(msg.pools),
        check_text("peer_address", msg.peer_address),
        {f.pool: ArenaFile(check_text("arena_files.path", f.path), f.size_bytes,
                           check_text("arena_files.boot_id", f.boot_id), f.device, f.inode)
         for f in msg.arena_files},
    )


def hello_to_response(hello: DaemonHello) -> pb.HandshakeResponse:
    """The accepting side's hello."""
    return pb.HandshakeResponse(
        session_id=hello.session_id, ucx_host=hello.ucx_host, ucx_port=hello.ucx_ports[0],
        ucx_ports=hello.ucx_ports, ucx_error_handling=hello.ucx_error_handling,
        pools=[descriptor_to_proto(d) for d in hello.pools.values()],
        reads_locally=hello.reads_locally, protocol_version=PEER_PROTOCOL_VERSION,
    )


def hello_from_response(msg: pb.HandshakeResponse) -> DaemonHello:
    """Decode an accepting hello (its version and descriptors are validated)."""
    check_version(msg.protocol_version)
    return DaemonHello(msg.session_id, msg.ucx_host, tuple(msg.ucx_ports) or (msg.ucx_port,),
                       msg.ucx_error_handling, _pools(msg.pools),
                       reads_locally=msg.reads_locally)


def _pools(msgs: Iterable[pb.PoolDescriptor]) -> dict[str, PoolDescriptor]:
    descriptors = [descriptor_from_proto(m) for m in msgs]
    return {d.name: d for d in descriptors}


def claim_to_proto(claim: Claim) -> pb.ClaimRequest:
    """A claim as its request message."""
    return pb.ClaimRequest(
        transfer_id=claim.transfer_id, session_id=claim.session_id, src_pool=claim.src_pool,
        src_runs=runs_to_proto(claim.src_runs), verify=claim.verify,
        chunk_bytes=claim.chunk_bytes, lanes=claim.lanes, capability=claim.capability,
    )


def claim_from_proto(msg: pb.ClaimRequest) -> Claim:
    """Decode a claim (its ids, runs and message size are validated)."""
    if msg.chunk_bytes and msg.chunk_bytes < MIN_CHUNK_BYTES:
        raise InvalidArgumentError(f"chunk_bytes={msg.chunk_bytes}; expected 0 (the receiver's) "
                                f"or at least {MIN_CHUNK_BYTES}")
    return Claim(check_id("transfer_id", msg.transfer_id), check_id("session_id", msg.session_id),
                 msg.src_pool, runs_from_proto(msg.src_runs),
                 msg.verify, msg.chunk_bytes, msg.lanes,
                 check_text("capability", msg.capability))


def grant_to_proto(grant: ClaimGrant) -> pb.ClaimResponse:
    """A claim's answer as its response message."""
    return pb.ClaimResponse(tag_base=grant.tag_base, dst_pool=grant.dst_pool,
                            dst_runs=runs_to_proto(grant.dst_runs), lanes=grant.lanes,
                            copied=grant.copied)


def grant_from_proto(msg: pb.ClaimResponse) -> ClaimGrant:
    """Decode a claim's answer (0 lanes means 1)."""
    return ClaimGrant(msg.tag_base, msg.dst_pool, runs_from_proto(msg.dst_runs), msg.lanes or 1,
                      msg.copied)


def commit_to_proto(commit: Commit) -> pb.CommitRequest:
    """A commit as its request message."""
    return pb.CommitRequest(transfer_id=commit.transfer_id, session_id=commit.session_id,
                            checksums=commit.checksums)


def commit_from_proto(msg: pb.CommitRequest) -> Commit:
    """Decode a commit (its ids are validated)."""
    return Commit(check_id("transfer_id", msg.transfer_id), check_id("session_id", msg.session_id),
                  tuple(msg.checksums))


def pull_ask_to_proto(request: PullAsk) -> pb.RequestPushRequest:
    """A push request as its message."""
    msg = pb.RequestPushRequest(transfer_id=request.transfer_id, reply_to=request.reply_to,
                                capability=request.capability,
                                prompt_digest=request.prompt_digest,
                                skip_pages=request.skip_pages, part=part_to_proto(request.part))
    where = request.placement
    if where is not None:
        msg.placement.CopyFrom(pb.PullPlacement(
            session_id=where.session_id, dst_pool=where.dst_pool,
            dst_runs=runs_to_proto(where.dst_runs), tag_base=where.tag_base, lanes=where.lanes,
            chunk_bytes=where.chunk_bytes))
    return msg


def pull_ask_from_proto(msg: pb.RequestPushRequest) -> PullAsk:
    """Decode a push request (its id, address, capability, digest and placement are validated)."""
    if not msg.reply_to:
        raise InvalidArgumentError("reply_to is empty; expected the puller's peer address host:port")
    placement = None
    if msg.HasField("placement"):
        where = msg.placement
        if where.chunk_bytes < MIN_CHUNK_BYTES or where.lanes < 1:
            raise InvalidArgumentError(
                f"placement.chunk_bytes={where.chunk_bytes}, placement.lanes={where.lanes}; "
                f"expected at least {MIN_CHUNK_BYTES} bytes and 1 lane")
        placement = Placement(check_id("placement.session_id", where.session_id),
                              check_text("placement.dst_pool", where.dst_pool),
                              runs_from_proto(where.dst_runs), where.tag_base, where.lanes,
                              where.chunk_bytes)
    return PullAsk(check_id("transfer_id", msg.transfer_id), check_text("reply_to", msg.reply_to),
                   check_text("capability", msg.capability), check_digest(msg.prompt_digest),
                   placement, msg.skip_pages, part_from_proto(msg.part))


def started_to_proto(started: PushStarted | None) -> pb.RequestPushResponse:
    """A push request's answer: how the sender sends, or nothing (it claims)."""
    if started is None:
        return pb.RequestPushResponse()
    return pb.RequestPushResponse(started=pb.PushStarted(
        src_pool=started.src_pool, src_runs=runs_to_proto(started.src_runs),
        chunks=started.chunks, lanes=started.lanes, verify=started.verify))


def started_from_proto(msg: pb.RequestPushResponse) -> PushStarted | None:
    """Decode a push request's answer (None: the sender claims as for a push)."""
    if not msg.HasField("started"):
        return None
    s = msg.started
    return PushStarted(s.src_pool, runs_from_proto(s.src_runs), s.chunks, s.lanes or 1, s.verify)


def abort_to_proto(abort: PeerAbort) -> pb.AbortTransferRequest:
    """An abort as its message."""
    return pb.AbortTransferRequest(transfer_id=abort.transfer_id, session_id=abort.session_id,
                                   reason=abort.reason, capability=abort.capability)


def abort_from_proto(msg: pb.AbortTransferRequest) -> PeerAbort:
    """Decode an abort (an empty session id: the transfer was not claimed yet)."""
    return PeerAbort(check_id("transfer_id", msg.transfer_id), check_text("session_id", msg.session_id),
                     check_text("reason", msg.reason), check_text("capability", msg.capability))
