"""What preflight prints comes partly from other machines (host names, environment values, log
lines): escape sequences in it are shown, never obeyed by the terminal, and JUnit stays valid
XML. Before, a host name could clear the screen or retitle the window, and a control character
made the JUnit file unparsable."""

from __future__ import annotations

from pathlib import Path
from xml.etree import ElementTree

from preflight.text import printable, printable_lines

from conftest import Runner, write

ATTACK = "\x1b[2J\x1b]0;owned\x07\u202egpu017\r"


def test_the_helpers_show_what_they_are_given() -> None:
    assert printable("gpu017") == "gpu017"
    shown = printable(ATTACK)
    assert "\x1b" not in shown and "\u202e" not in shown and "\r" not in shown and "\x07" not in shown
    assert shown == "\\x1b[2J\\x1b]0;owned\\x07\\u202egpu017\\r"
    assert printable_lines("a\x1bb\nc") == "a\\x1bb\nc"
    assert printable_lines("ok line\nnext\x00\ufffe") == "ok line\nnext\\x00\\ufffe"  # XML-invalid ones too


def test_a_hostile_host_name_and_environment_stay_visible_text(run_cli: Runner, node_copy: Path) -> None:
    write(node_copy, "/proc/sys/kernel/hostname", ATTACK + "\n")
    environ = (node_copy / "proc/self/environ").read_bytes()
    write(node_copy, "/proc/self/environ", environ + "NCCL_SOCKET_IFNAME=\x1b[8mhidden\x1b[0m\0".encode())
    for output in ("table", "junit"):
        result = run_cli("node", "--root", str(node_copy), "--format", output, "--show-all")
        assert result.returncode in (0, 1, 2), result.stderr
        assert "\x1b" not in result.stdout and "\x07" not in result.stdout and "\u202e" not in result.stdout
        if output == "junit":
            ElementTree.fromstring(result.stdout.split("\n", 1)[1])  # parses: no XML-invalid character left
        else:
            assert "\\x1b[2J" in result.stdout


def test_explain_shows_escape_sequences_of_a_log_as_text(run_cli: Runner, tmp_path: Path) -> None:
    log = tmp_path / "rank0.log"
    log.write_bytes(b"host\x1b]0;pwned\x07: NCCL WARN NET/IB : Got completion from peer 10.0.0.2 with status=12 opcode=0 len=0 vendor err 129 (Recv)\n")
    result = run_cli("explain", str(log))
    assert result.returncode in (1, 2), result.stderr
    assert "\x1b" not in result.stdout and "\x07" not in result.stdout
    assert "\\x1b]0;pwned\\x07" in result.stdout
