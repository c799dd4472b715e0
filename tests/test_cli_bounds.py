"""Command-line values past what the servers, gRPC and protobuf can hold: one line that names
the flag, exit 2, no traceback; an address whose port is not a port is refused, not wrapped.

Found by a probe of the CLI: ``--max-receive-mb 2048``, ``--max-wait-s inf``, ``--grace inf``,
``--max-memory`` of 400 nines, ``--max-pending-calls 100000000000``, a tool's ``--contributors
-1`` and ``status --max-pending 99999999999`` ended in a Python traceback; ``--timeout inf``
made every call fail at once; ``serve --restore T --index -1`` served empty with exit 0; and
``127.0.0.1:99999`` reached port 34463 (gRPC takes the port modulo 65536), whose server
answered as the one named.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cli import paramshard

from paramshard import cli, commands
from paramshard.client import ClusterSpec


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["serve", "--max-wait-s", "inf"], "argument --max-wait-s: inf is not a number in (0,"),
        (["serve", "--grace", "1e12"], "argument --grace: 1e12 is not a number in [0,"),
        (["serve", "--max-pending-calls", "100000000000"], "is not an integer in 1..2,147,"),
        (["serve", "--max-sessions", "-1"], "argument --max-sessions: -1 is not an integer in"),
        (["serve", "--index", "-1"], "argument --index: -1 is not an integer in 0..65,535"),
        (["serve", "--num-servers", "99999999999"], "is not an integer in 1..65,536"),
        (["status", "--max-pending", "99999999999"], "is not an integer in 1..2,147,483,647"),
        (["inspect", "j", "--timeout", "inf"], "argument --timeout: inf is not a number in (0,"),
        (["inspect", "j", "--timeout", "nan"], "argument --timeout: nan is not a number in (0,"),
        (["restore", "j", "--contributors", "-1"], "is not an integer in 0..4,294,967,295"),
    ],
)
def test_a_number_past_its_bound_is_a_usage_error(argv: list[str], said: str, capsys) -> None:
    if argv[0] == "serve":  # in a process of its own: a serve that parsed would re-execute
        result = paramshard(*argv, timeout=60)
        code, err = result.returncode, result.stderr
    else:
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        code, err = exc.value.code, capsys.readouterr().err
    assert code == 2, err
    assert said in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--max-receive-mb", "2048"], "must be an int in 1024..2**31 - 1"),
        (["--max-memory", "9" * 400], "is past any memory"),
    ],
)
def test_a_serve_setting_past_grpcs_bounds_is_one_line(flags: list[str], said: str) -> None:
    """These pass the flag's own type and fail in the server's config (a subprocess: serve
    re-executes itself)."""
    result = paramshard("serve", "--port", "0", *flags, timeout=60)
    assert result.returncode == 2, result.stderr
    assert said in result.stderr and "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize(
    "address", ["127.0.0.1:99999", "127.0.0.1:", "127.0.0.1:-1", "127.0.0.1:0", "h:abc"]
)
def test_an_address_whose_port_is_not_a_port_is_refused(address: str) -> None:
    with pytest.raises(ValueError, match="the port must be 1..65535"):
        ClusterSpec([address])


def test_a_server_token_file_with_scopes_gives_its_first_train_token(tmp_path: Path) -> None:
    """The launcher and the tools take the train (else admin) token of the server's own token
    file; a scope after it (docs/security.md's example) was refused."""
    path = tmp_path / "tokens"
    path.write_text(
        "# team A\nread tok-a-r jobs=team-a-*\ntrain tok-a-1 jobs=team-a-*\n"
        "train tok-a-2 jobs=team-a-*\nadmin tok-a-ops jobs=team-a-*\n"
    )
    assert commands.read_token(str(path)) == "tok-a-1"
    assert commands.read_token(str(path), prefer=("admin",)) == "tok-a-ops"


def test_a_token_file_is_read_to_a_bound(tmp_path: Path) -> None:
    """``--token-file /dev/zero`` read until the process was killed."""
    from paramshard.server.rpc.tokens import MAX_TOKEN_FILE_BYTES, load_token_file

    path = tmp_path / "tokens"
    path.write_text("train " + "x" * MAX_TOKEN_FILE_BYTES + "\n")
    with pytest.raises(commands.CommandError, match="longer than a token file"):
        commands.read_token(str(path))
    with pytest.raises(ValueError, match="longer than a token file"):
        load_token_file(str(path))


def test_a_key_that_is_not_the_certificates_is_named_as_a_cause(tmp_path: Path) -> None:
    """gRPC fails to bind, and says only that; the port was free a moment before."""
    from pki import make_pki

    pki = make_pki({"one": ("one", ["localhost"]), "two": ("two", ["localhost"])})
    (tmp_path / "cert.pem").write_bytes(pki["one"])
    (tmp_path / "key.pem").write_bytes(pki["two_key"])
    flags = ["--tls-cert", str(tmp_path / "cert.pem"), "--tls-key", str(tmp_path / "key.pem")]
    result = paramshard("serve", "--port", "0", *flags, timeout=60)
    assert result.returncode != 0, result.stderr
    assert "--tls-key is not the key of --tls-cert" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
