"""``kvxfer-health``: the container's health probe, light enough to run every few seconds.

It asks a daemon's standard gRPC health service (``grpc.health.v1.Health/Check``)
and exits 0 when it answers SERVING, 1 otherwise (NOT_SERVING while it starts or
drains, or no answer within the timeout). Only grpcio is imported, so a probe
costs a fraction of a second, not the seconds ``kvxfer health`` spends importing torch.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import grpc
from grpc_health.v1 import health_pb2


def health_check(channel: grpc.Channel) -> grpc.UnaryUnaryMultiCallable[Any, Any]:
    """The standard ``Health/Check`` method on ``channel``."""
    return channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString)


def check(address: str, timeout_s: float, service: str = "") -> str:
    """The health status name the daemon at ``address`` reports for ``service``."""
    with grpc.insecure_channel(address) as channel:
        reply = health_check(channel)(health_pb2.HealthCheckRequest(service=service),
                                      timeout=timeout_s)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def build_parser() -> argparse.ArgumentParser:
    """The probe's argument parser."""
    parser = argparse.ArgumentParser(prog="kvxfer-health", description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default="unix:///run/kvxfer/kvxfer.sock",
                        help="the daemon's worker address (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the probe; the exit code says whether the daemon serves."""
    args = build_parser().parse_args(argv)
    try:
        status = check(args.address, args.timeout)
    except grpc.RpcError as exc:
        assert isinstance(exc, grpc.Call)
        print(f"kvxfer-health: {args.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
