"""The wire contract (shard.proto), its generated modules, the tensor codec and the slice rule."""
