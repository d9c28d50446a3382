"""The daemon's two gRPC services: ``worker`` (for engines on this node) and ``peer`` (for
other daemons). Each method decodes its request, calls the pools or the transfer
coordinator, and encodes the answer; errors are mapped by the interceptors."""
