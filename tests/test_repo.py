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
    """Output locations come from arguments: benchmarks take ``--json PATH`` (and
    ``--plot PNG``), scripts a directory argument; no code reads one from the environment."""
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


def test_the_repository_speaks_of_the_product_only():
    """Text and result file names speak in shapes, devices, versions and dates (not in
    numbered rounds of work), and name no path outside the repository."""
    import re  # noqa: PLC0415

    pattern = re.compile(r"\bsessions?\b|\bissue ?#?\d|\bissue's\b|\blent\b|/work/|\bticket|\brounds? ?-?\d",
                         re.IGNORECASE)
    allowed = re.compile(r"""@pytest\.fixture\(scope=["']\w+["']\)""")  # a fixture scope is a pytest word
    offenders = []
    for path in [*ROOT.glob("*.md"), *ROOT.glob("docs/*.md"), *ROOT.glob("cascadeinfer/**/*.py"),
                 *ROOT.glob("benchmarks/*.py"), *ROOT.glob("benchmarks/*.md"), *ROOT.glob("benchmarks/*.sh"),
                 *ROOT.glob("tests/*.py"), *ROOT.glob("examples/*.py"), ROOT / "pyproject.toml"]:
        if path.name == "test_repo.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(allowed.sub("", line)):
                offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()[:80]}")
    offenders += [str(p.relative_to(ROOT)) for p in ROOT.glob("benchmarks/results/*")
                  if re.search(r"_s\d+(_|\.)|_run\d", p.name)]
    # Results are named by what they measure, the device and the date of the run.
    offenders += [f"{p.relative_to(ROOT)}: no device and date in the name" for p in ROOT.glob("benchmarks/results/*")
                  if not re.search(r"_(\dx)?h[12]00_20\d\d-\d\d-\d\d", p.name)]
    assert not offenders, "\n".join(offenders)


def test_benchmarks_import_and_share_fixtures_only():
    """Every benchmark and tool imports on a CPU (their GPU work starts in main()), and a
    benchmark takes what it shares from ``benchmarks._common`` and ``benchmarks.fixtures``,
    never from another benchmark."""
    import ast  # noqa: PLC0415
    import importlib  # noqa: PLC0415

    offenders = []
    for path in sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("benchmarks/tools/*.py")]):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        importlib.import_module(module)
        if path.parent.name != "benchmarks":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks.") \
                    and node.module not in ("benchmarks._common", "benchmarks.fixtures"):
                offenders.append(f"{path.name} imports {node.module}")
    assert not offenders, offenders


def test_layouts_are_plain_torch():
    """``cascadeinfer.layouts`` (caches, page tables, the pool) imports no Triton: kernels
    live in ``cascadeinfer.kernels``, and data flows layouts <- kernels <- cascade <- engine."""
    import ast  # noqa: PLC0415

    offenders = []
    for path in ROOT.glob("cascadeinfer/layouts/*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.name}: {n}" for n in names
                          if n.split(".")[0] == "triton" or n.startswith(("cascadeinfer.kernels", "cascadeinfer.cascade",
                                                                          "cascadeinfer.engine"))]
    assert not offenders, offenders
