"""The project's promises about itself: CI runs the README's test command."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [line.strip() for line in readme.splitlines() if "pytest" in line and line.startswith("    ")]
    assert len(commands) == 1, commands
    assert commands[0] in ci.splitlines()
