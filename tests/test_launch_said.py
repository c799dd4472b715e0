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
