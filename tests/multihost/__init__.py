"""Multi-host tests: shard servers and trainers on separate network namespaces ("hosts")."""
