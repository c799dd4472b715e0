"""Neighbour replicas: sending this server's slices to its neighbour, receiving the neighbour's,
and recovering a lost server from them."""
