"""Reduction slots and mailboxes (what tensor-parallel all-reduces, DDP buckets, broadcasts,
barriers and pipeline sends meet in), the hang doctor that names who a wait waits for, and
trainers' leases."""
