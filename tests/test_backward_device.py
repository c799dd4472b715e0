"""``claim_backward_device``: thread ranks of one group may not share a CUDA device when they
wait for each other inside backward (strategies/device.py); the rule itself needs no GPU.

torch runs the backward of CUDA tensors on one autograd thread per device, shared by the
process's threads. On an H200, DDP and tensor parallelism as two thread ranks on cuda:0 waited
out their 60 s deadline ("1 of 2 contributions arrived; missing rank(s) 0"): tests/test_cuda.py
checks the refusal there, and this file checks who is refused and who is not.
"""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import torch

from paramshard.local_cluster import RankFailed, run_in_threads
from paramshard.strategies.device import backward_claims, claim_backward_device

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)  # names only: no GPU is used


def group(rank: int, run_id: str, world_size: int = 2) -> SimpleNamespace:
    """What the claim reads of a group's client."""
    return SimpleNamespace(rank=rank, world_size=world_size, run_id=run_id)


def in_thread(fn) -> BaseException | None:
    """Runs ``fn`` in a thread of its own (LocalCluster's thread runner), which has ended when
    it succeeds; what it raised, if anything."""
    try:
        run_in_threads([fn], timeout_s=10)
    except RankFailed as failed:
        return failed.error
    return None


def test_a_second_thread_rank_on_the_same_device_is_refused_by_name() -> None:
    run = uuid.uuid4().hex
    claim_backward_device(CUDA0, group(0, run), "DDP's end-of-backward all-reduce")
    error = in_thread(lambda: claim_backward_device(CUDA0, group(1, run), "the all-reduce"))
    assert isinstance(error, ValueError)
    message = str(error)
    assert f"rank 1 and rank 0 of group {run!r}" in message
    assert "cuda:0" in message and "the all-reduce waits inside backward" in message
    assert "LocalCluster(processes=True)" in message and "cuda:<rank>" in message


def test_what_may_share() -> None:
    run = uuid.uuid4().hex
    claim_backward_device(CUDA0, group(0, run), "x")
    claim_backward_device(CUDA0, group(0, run), "x")  # again, each forward
    claim_backward_device(CUDA0, group(1, run), "x")  # another rank from the same thread
    # another group, another GPU, the CPU, a group of one: none waits on this thread's group
    assert in_thread(lambda: claim_backward_device(CUDA0, group(1, run + "-tp"), "x")) is None
    assert in_thread(lambda: claim_backward_device(CUDA1, group(1, run), "x")) is None
    assert in_thread(lambda: claim_backward_device(torch.device("cpu"), group(1, run), "x")) is None
    alone = group(0, run, world_size=1)
    assert in_thread(lambda: claim_backward_device(CUDA0, alone, "x")) is None


def test_a_claim_ends_with_its_thread() -> None:
    """A rank rebuilt in a new thread (a notebook's second run under the same group id) claims
    again once the thread of the first has ended."""
    run = uuid.uuid4().hex
    assert in_thread(lambda: claim_backward_device(CUDA0, group(0, run), "x")) is None
    claim_backward_device(CUDA0, group(1, run), "x")  # rank 0's thread is gone
    error = in_thread(lambda: claim_backward_device(CUDA0, group(0, run), "x"))
    assert isinstance(error, ValueError) and "rank 0 and rank 1" in str(error)


def test_groups_whose_threads_ended_are_forgotten() -> None:
    """A process that trains group after group in threads keeps only the live groups' claims:
    the claims of ended threads, and their groups, go at the next claim or look."""
    runs = [uuid.uuid4().hex for _ in range(3)]
    for run in runs:  # each group's rank 0 in a thread that has ended
        assert in_thread(lambda run=run: claim_backward_device(CUDA0, group(0, run), "x")) is None
    live = uuid.uuid4().hex
    claim_backward_device(CUDA1, group(1, live), "x")  # this thread, still running
    claims = backward_claims()
    assert not any(run in key for key in claims for run in runs), claims
    assert claims[(live, "cuda:1")] == [1]
