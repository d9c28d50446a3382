"""Conversions between kvxfer's types and their protobuf messages (besides descriptors)."""

from __future__ import annotations

from collections.abc import Iterable

from kvxfer.pages import Extent, PageRuns
from kvxfer.v1 import kvxfer_pb2 as pb


def runs_to_proto(runs: PageRuns) -> list[pb.PageRun]:
    """``PageRuns`` as repeated ``PageRun`` messages."""
    return [pb.PageRun(start=r.start, count=r.count) for r in runs.runs]


def runs_from_proto(msgs: Iterable[pb.PageRun]) -> PageRuns:
    """``PageRun`` messages as validated, normalized ``PageRuns``."""
    return PageRuns.of((int(m.start), int(m.count)) for m in msgs)


def extents_to_proto(extents: Iterable[Extent]) -> list[pb.Extent]:
    """Byte extents as repeated ``Extent`` messages."""
    return [pb.Extent(src_offset=e.src_offset, dst_offset=e.dst_offset, nbytes=e.nbytes) for e in extents]
