"""The launcher's summary of a rank that failed names its error even when the rank failed
before paramshard could declare it (a bad config file, an import, any error before the first
client): "rank 0 failed with exit code 1" said nothing more before, though the error was in
the rank's own output above (a newcomer's walkthrough: an unknown key in ``--config``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from launching import launch

pytestmark = pytest.mark.timeout(120)


def test_an_error_before_any_client_is_named_in_the_summary(tmp_path: Path) -> None:
    script = tmp_path / "early.py"
    script.write_text(
        "from paramshard import ShardingConfiguration\n"
        "ShardingConfiguration.from_file(__file__.replace('early.py', 'bad.toml'))\n"
    )
    (tmp_path / "bad.toml").write_text("gradient_accumulation_step = 2\n")
    result = launch("--nproc", "1", "--grace", "1", script)
    assert result.returncode == 1, result.stdout + result.stderr
    summary = [line for line in result.stderr.splitlines() if "rank 0 failed" in line]
    assert summary, result.stderr
    assert "gradient_accumulation_step" in summary[0] and "Error: " in summary[0], summary


def test_an_elastic_rank_that_leaves_on_an_error_is_named_with_it(tmp_path: Path) -> None:
    """``launch --elastic``: a rank whose script raised left the job with "rank 1 failed with
    exit code 1; it left the elastic job, 1 rank(s) train on", its error only in its own
    output above (a walkthrough's HybridShardedModel refusal). Its error is named there now,
    as for a rank that is restarted."""
    script = tmp_path / "leaves.py"
    script.write_text(
        "import time\n"
        "from paramshard import ShardingConfiguration\n"
        "config = ShardingConfiguration.from_env(job='leaves')\n"
        "if config.rank == 1:\n"
        "    raise ValueError('bad batch 3')\n"
        "time.sleep(4)\n"
    )
    result = launch("--nproc", "2", "--elastic", "--min-nproc", "1", "--grace", "1", script)
    left = [line for line in result.stderr.splitlines() if "left the elastic job" in line]
    assert left, result.stdout[-2000:] + result.stderr[-2000:]
    assert "ValueError: bad batch 3" in left[0], left
