"""The kvxfer daemon (``kvxfer serve``), as the package ``kvxfer.server``.

- ``config``: the settings (file, environment, flags) and the pools to serve;
- ``pools``: the arenas and pools this daemon owns;
- ``transfers``: the transfer state machine (record, registry, planning,
  sender, receiver, coordinator);
- ``sessions``: sessions with peer daemons in both directions, and heartbeats;
- ``peer_protocol`` / ``peer_client``: the peer API's messages, and typed calls to peers;
- ``servicers``: the two gRPC services (workers', peers') as thin translations;
- ``interceptors``: error mapping and per-RPC metrics for every method;
- ``metrics``: the daemon's Prometheus metrics;
- ``daemon``: wires it all, serves, and shuts down in order.
"""
