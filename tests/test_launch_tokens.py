"""``paramshard launch --token-file`` without ``--servers``: the local servers check the tokens
(paramshard/local_tokens.py). Before, they were started without tokens whatever the file
said, and a mistyped token or a read token deleted snapshots (a field check)."""

from __future__ import annotations

import re
import stat
from pathlib import Path

import pytest
from launching import launch, launch_env

from paramshard.commands import CommandError, read_token
from paramshard.local_tokens import LocalTokens

pytestmark = pytest.mark.timeout(150)

RANK = """
import os
from paramshard.client import ClusterSpec, ShardClient, ShardClientError
from paramshard.protos import shard_pb2 as pb
addresses = os.environ["PARAMSHARD_SERVERS"].split(",")
for token in ["wrong", "r-token", os.environ["PARAMSHARD_TOKEN"]]:
    client = ShardClient(ClusterSpec(addresses, token=token), timeout_s=10, retries=0)
    try:
        client.call(0, "Status", pb.StatusRequest())
        client.call(0, "DropJob", pb.DropJobRequest(job="j"))
        print("TOKEN", token == os.environ["PARAMSHARD_TOKEN"], "OK", flush=True)
    except ShardClientError as exc:
        print("TOKEN", token == os.environ["PARAMSHARD_TOKEN"], exc.code.name, flush=True)
    finally:
        client.close()
"""


def said(stdout: str) -> list[str]:
    return re.findall(r"^\[rank 0\] TOKEN (.*)$", stdout, re.M)


def test_a_server_token_file_is_checked_by_the_local_servers(tmp_path: Path) -> None:
    """The ranks get the train token: a wrong token is refused, the read token may look but
    not drop a job, nor may the ranks' train token."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    tokens = tmp_path / "tokens"
    tokens.write_text("read r-token\ntrain t-token\nadmin a-token\n")
    tokens.chmod(0o600)
    done = launch("--nproc", "1", "--token-file", tokens, script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert said(done.stdout) == [
        "False UNAUTHENTICATED",
        "False PERMISSION_DENIED",
        "True PERMISSION_DENIED",
    ], done.stdout


def test_one_bare_token_is_the_admin_token_of_the_local_servers(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    token = tmp_path / "token"
    token.write_text("a-token\n")
    token.chmod(0o600)
    temp = tmp_path / "tmp"  # where the launcher makes the servers' file
    temp.mkdir()
    done = launch("--nproc", "1", "--token-file", token, script, env=launch_env(TMPDIR=str(temp)))
    assert done.returncode == 0, done.stderr[-3000:]
    # the admin role passes: DropJob then finds no job 'j' (NOT_FOUND, after the role check)
    assert said(done.stdout) == ["False UNAUTHENTICATED", "False UNAUTHENTICATED", "True NOT_FOUND"]
    assert not list(temp.glob("paramshard-tokens-*"))  # removed as the launcher ends


REPLICATING = """
import time, torch
from paramshard.protos import shard_pb2 as pb
from paramshard.strategies import FSDPModel, FSDPOptimizer, ShardingConfiguration
config = ShardingConfiguration.from_env(job="rep", replicate_every=1)
model = FSDPModel(torch.nn.Linear(4, 2), config)
opt = FSDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), config)
for _ in range(3):
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
for _ in range(100):  # replicas travel in the background
    listed = config.client.call(1, "ListReplicas", pb.ListReplicasRequest(job="rep"))
    held = [r for r in listed.replicas if not r.own]
    if held:
        break
    time.sleep(0.1)
print("HELD", sorted({r.source_index for r in held}), flush=True)
"""


@pytest.mark.parametrize("tokens", ["a-token\n", "read r-token\nadmin a-token\n"])
def test_the_local_servers_replicate_with_a_peer_token_of_their_own(tmp_path, tokens) -> None:
    """A file without a peer line: the servers get one of their own, so that replicas travel
    between them (with tokens and no peer token a server refuses to replicate)."""
    script = tmp_path / "rank.py"
    script.write_text(REPLICATING)
    token = tmp_path / "token"
    token.write_text(tokens)
    token.chmod(0o600)
    done = launch("--nproc", "2", "--token-file", token, script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.findall(r"^\[rank \d\] HELD (.*)$", done.stdout, re.M) == ["[0]", "[0]"], done.stdout


CHECKPOINTING = """
import torch
from paramshard.strategies import FSDPModel, FSDPOptimizer, ShardingConfiguration
from paramshard.strategies import train_with_recovery
config = ShardingConfiguration.from_env(job="ckpt")
model = FSDPModel(torch.nn.Linear(4, 2), config)
opt = FSDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), config)
def step(s):
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    return 0.0
train_with_recovery(model, step, 4, checkpoint_every=2)
"""


def test_ranks_with_the_train_token_stop_at_the_first_checkpoint_unrestarted(tmp_path) -> None:
    """Ranks given a server token file's train token may not checkpoint: the run ends on its
    first checkpoint, the launcher naming rank 0's PermissionError, and neither rank is
    restarted (a new process would meet the same refusal, or stop on the same notice)."""
    script = tmp_path / "rank.py"
    script.write_text(CHECKPOINTING)
    tokens = tmp_path / "tokens"
    tokens.write_text("train t-token\nadmin a-token\n")
    tokens.chmod(0o600)
    done = launch("--nproc", "2", "--max-restarts", "2", "--token-file", tokens, script)
    said = re.findall(r"paramshard launch: (rank \d failed .*)", done.stderr)
    assert done.returncode == 1, (said, done.stderr[-3000:])
    assert len(said) == 1 and said[0].startswith(
        "rank 0 failed with exit code 1: PermissionError: train_with_recovery cannot snapshot"
    ), said
    assert "(not restarted: its own error ended the run on every rank" in said[0], said


def test_the_servers_copy_is_private_and_the_file_is_checked_as_written(tmp_path, capsys) -> None:
    """Errors name the user's file and its own line (comments counted), a file others may
    read is warned of as ``paramshard serve`` warns, and the copy is 0600 in a 0700 folder."""
    tokens = tmp_path / "tokens"
    tokens.write_text("# team\nread r\n\n# rotated\nadmin a\ntrain t jobs=\n")
    tokens.chmod(0o600)
    with pytest.raises(CommandError, match=f"{tokens} line 6: jobs= needs"):
        LocalTokens().serve_args(str(tokens))
    tokens.write_text("read r\nadmin a\n")
    tokens.chmod(0o644)
    made = LocalTokens()
    args = made.serve_args(str(tokens))
    assert f"{tokens} is readable by group or others" in capsys.readouterr().err
    copy = Path(args[1])
    assert stat.S_IMODE(copy.stat().st_mode) == 0o600
    assert stat.S_IMODE(copy.parent.stat().st_mode) == 0o700
    assert copy.read_text().startswith("read r\nadmin a\npeer ")
    made.close()
    assert not copy.parent.exists()


@pytest.mark.parametrize("word", ["train", "admin", "peer", "read"])
def test_a_role_name_alone_is_no_token(tmp_path: Path, word: str) -> None:
    """A one-word file is the ranks' token and the local servers' admin token; a role name
    alone is a ``ROLE TOKEN`` line that lost its token. Before, ``train`` alone became the
    admin token "train" of the local servers and the token of every rank."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# ours\n{word}\n")
    tokens.chmod(0o600)
    error = f"its one line is the role name '{word}' with no token after it"
    with pytest.raises(CommandError, match=error):
        LocalTokens().serve_args(str(tokens))
    with pytest.raises(CommandError, match=error):
        read_token(str(tokens))
    tokens.write_text(f"{word}x\n")  # a token that only begins like a role is a token
    assert read_token(str(tokens)) == f"{word}x"
