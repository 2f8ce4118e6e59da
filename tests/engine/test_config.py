"""The site config: the samples the docs show load with the real loader, and reference IDs
are checked against the catalogue (an override or a disable of a misspelt ID is refused)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

import preflight.config
from conftest import REPO, Runner
from preflight.config import ConfigError, parse_config
from preflight.model import Severity


def docstring_sample() -> str:
    """The TOML block of ``preflight/config.py``'s docstring, which docs/operators/configuration.md sends readers to."""
    doc = preflight.config.__doc__ or ""
    block = doc.split(".. code-block:: toml\n", 1)[1].split("\nEvery unknown key", 1)[0]
    return textwrap.dedent(block)


def test_docstring_sample_loads_and_means_what_its_comments_say() -> None:
    text = docstring_sample()
    inside = parse_config(text, "sample.toml", "gpu017")  # matched by [[hosts]] gpu[001-064]
    outside = parse_config(text, "sample.toml", "login1")
    assert outside.disabled == {"GDR002"} and inside.disabled == {"GDR002", "DNS001"}
    assert outside.severity == {"MEM002": Severity.ERROR}
    assert inside.severity == {"MEM002": Severity.ERROR, "GDR001": Severity.WARNING}
    assert (outside.expect.gpu_count, inside.expect.gpu_count) == (8, 4)
    assert outside.checks_dirs == ("/etc/preflight/checks.d",) and outside.dns.nameservers == ("10.0.0.2",)
    assert outside.slurm.healthcheck_timeout_s == 50.0


def test_operator_guide_configuration_samples_load() -> None:
    page = (REPO / "docs" / "operators" / "configuration.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", page, re.S)
    assert len(blocks) >= 2
    for block in blocks:
        parse_config(block, "configuration.md", "gpu017")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[severity]\nDSN001 = "warning"\n', ":2: severity.DSN001: is no reference in the catalogue, nor shipped by [run] checks_dirs or a plugin (did you mean DNS001?)"),
        ('disable = ["DSN001"]\n', ":1: disable: 'DSN001' is no reference in the catalogue, nor shipped by [run] checks_dirs or a plugin (did you mean DNS001?)"),
        ('disable = ["mem001"]\n', ":1: disable: 'mem001' is not a reference ID like MEM001 (did you mean MEM001?)"),
        ('[[hosts]]\nmatch = "gpu*"\nseverity = { ZZZ999 = "info" }\n', ":3: hosts[0].severity.ZZZ999: is no reference in the catalogue, nor shipped by [run] checks_dirs or a plugin\n"),
        ('[[hosts]]\nmatch = "other*"\ndisable = ["GDR001", "GRD002"]\n', ":3: hosts[0].disable: 'GRD002' is no reference in the catalogue, nor shipped by [run] checks_dirs or a plugin (did you mean GDR002?)"),
    ],
)
def test_unknown_reference_ids_are_refused(run_cli: Runner, example_root: Path, tmp_path: Path, text: str, message: str) -> None:
    config = tmp_path / "site.toml"
    config.write_text(text)
    result = run_cli("node", "--root", str(example_root), "--config", str(config))
    assert result.returncode == 3 and result.stdout == ""
    assert result.stderr == f"preflight: error: {config}{message}" + ("" if message.endswith("\n") else "\n")


def test_known_ids_in_every_place_are_accepted() -> None:
    text = '[severity]\nDNS001 = "warning"\n[[hosts]]\nmatch = "gpu*"\nseverity = { GDR001 = "info" }\ndisable = ["GDR002"]\n'
    config = parse_config("disable = [\"SOCK002\"]\n" + text, "site.toml", "gpu1")
    assert config.disabled == {"SOCK002", "GDR002"} and config.severity == {"DNS001": Severity.WARNING, "GDR001": Severity.INFO}
    with pytest.raises(ConfigError, match="NCCL999"):
        parse_config('disable = ["NCCL999"]\n', "site.toml", "gpu1")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[run]\ntimeout = 1e10\n", "run.timeout: 10000000000.0 must be a positive number of seconds, at most 86400"),
        ("[slurm]\ntimeout = 1e10\n", "slurm.timeout: 10000000000.0 must be a positive number of seconds, at most 86400"),
        ('[slurm]\nlast_result = "/var/lib/preflight/{mode:>99999999999}.json"\n', "may contain no placeholder other than {mode}"),
        ('[slurm]\nlast_result = "/var/lib/preflight/{mode!r}.json"\n', "may contain no placeholder other than {mode}"),
        ('[dns]\nnameservers = ["not-an-ip"]\n', "'not-an-ip' is not an IP address"),
    ],
)
def test_values_that_would_crash_a_run_or_ask_the_wrong_server_are_refused(text: str, message: str) -> None:
    """A deadline past what select() takes, a format width that allocates gigabytes, a nameserver
    given by name (this machine's resolver would answer for it): each is a config error."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(text, "site.toml", "gpu1")
    assert parse_config('[slurm]\nlast_result = "/var/lib/preflight/{mode}.json"\n[dns]\nnameservers = ["10.0.0.2", "fd00::53"]\n', "site.toml", "gpu1")


@pytest.mark.parametrize("command", [("node",), ("slurm", "prolog")])
def test_a_timeout_past_a_day_is_a_usage_error_not_a_traceback(run_cli: Runner, example_root: Path, command: tuple[str, ...]) -> None:
    result = run_cli(*command, "--root", str(example_root), "--timeout", "1e10")
    assert "Traceback" not in result.stderr and "at most 86400" in result.stderr + result.stdout
