"""Snapshots on disk: the folder of tags, shard files written atomically, and the manifest's
checks."""
