"""How payloads travel besides plain gRPC messages: shared-memory segments for clients on this
host, and sessions (one stream per client)."""
