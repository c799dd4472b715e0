"""``paramshard health``: is a server serving (for Docker's HEALTHCHECK)."""

from __future__ import annotations

import argparse

from paramshard.commands import EXIT_FAILURE, CommandError, arg, cluster_spec, command, positive

__all__ = ["health"]


@command(
    arg("address", metavar="HOST:PORT", help="the server to check"),
    arg(
        "--timeout",
        type=positive,
        default=3.0,
        help="seconds to wait for the answer (default: %(default)g)",
    ),
    arg("--service", default="", help="service to check (default: the whole server)"),
    usage_exit=EXIT_FAILURE,
)
def health(args: argparse.Namespace) -> int:
    """Exit 0 if the server's grpc.health.v1 check says SERVING, else 1.

    Made for Docker HEALTHCHECK, which reserves exit code 2: every failure, including a
    malformed address, exits 1.
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from paramshard.client import unreachable
    from paramshard.protos.words import details_of

    if "," in args.address:
        raise CommandError(f"one address, not a list: {args.address!r}")
    try:
        spec = cluster_spec(args.address)
    except CommandError as exc:
        raise CommandError(str(exc)) from None
    address = spec.addresses[0]
    try:
        reply = health_pb2_grpc.HealthStub(spec.channel(0)).Check(
            health_pb2.HealthCheckRequest(service=args.service),
            timeout=args.timeout,
            metadata=spec.metadata(),
        )
    except grpc.RpcError as exc:
        words = unreachable.explain(address, exc.code(), details_of(exc))
        raise CommandError(f"{address}: {exc.code().name}: {words}") from None
    finally:
        spec.close()
    state = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{address}: {state}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else EXIT_FAILURE
