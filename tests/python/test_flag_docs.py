"""Every server flag `flashserve --help` lists has a row in README's "Server flags" table, and every row names a real
flag: the docs cannot silently fall behind the binary."""

import pathlib
import re
import subprocess

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def _help_flags(binary: str) -> set:
    text = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30).stdout
    # Only the flags flashserve defines (server/config/flags.cc), not Abseil's own (--flagfile, ...).
    ours = text.split("Flags from ", 1)[1]
    ours = ours.split("\n\n  Flags from ", 1)[0]
    return set(re.findall(r"^    --([a-z0-9_]+) \(", ours, flags=re.M))


def _readme_flags() -> set:
    section = README.read_text().split("## Server flags", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `--")]
    return {name for row in rows for name in re.findall(r"`--([a-z0-9_]+)`", row.split("|")[1])}


def test_every_flag_is_documented(flashserve_bin):
    flags = _help_flags(flashserve_bin)
    assert len(flags) > 30, f"could not parse --help ({len(flags)} flags)"
    documented = _readme_flags()
    assert flags - documented == set(), f"flags missing from README's Server flags table: {sorted(flags - documented)}"
    assert documented - flags == set(), f"README documents flags the binary does not have: {sorted(documented - flags)}"
