"""The project's promises about itself: CI runs the README's test command."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [line.strip() for line in readme.splitlines() if "pytest" in line and line.startswith("    ")]
    assert len(commands) == 1, commands
    assert commands[0] in ci.splitlines()


def test_output_locations_come_from_arguments():
    """No code decides where to write from an environment variable (``$OUT`` and the like):
    benchmarks take ``--json PATH`` (and ``--plot PNG``), scripts a directory argument."""
    import re  # noqa: PLC0415

    pattern = re.compile(r"""environ(\.get)?[\[(]\s*["'](OUT|OUT_DIR|OUTPUT_DIR|RESULTS_DIR)["']|\$\{?OUT\b""")
    offenders = []
    for path in [*ROOT.glob("cascadeinfer/**/*.py"), *ROOT.glob("benchmarks/**/*.py"), *ROOT.glob("benchmarks/*.sh"),
                 *ROOT.glob("tests/*.py"), *ROOT.glob("examples/*.py")]:
        if path.name == "test_repo.py":
            continue
        offenders += [f"{path.relative_to(ROOT)}:{i}" for i, line in enumerate(path.read_text().splitlines(), 1)
                      if pattern.search(line)]
    assert not offenders, offenders
