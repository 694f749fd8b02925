"""The layering holds by contract, not by care: import-linter's contracts (pyproject.toml)
pass on the tree and fail as soon as a forbidden import is added to a copy of it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CONTRACTS = {
    "smolnet is the base layer": ("smolnet/_probe.py", "import smoltrain.run.config\n"),
    "the planner is arithmetic": ("smoltrain/planner/_probe.py", "import torch\n"),
    "placement never imports its search": (
        "smoltrain/planner/placement.py",
        "\nimport smoltrain.planner.placement_plan\n",
    ),
    "the model never imports the transport": ("smoltrain/models/_probe.py", "from smoltrain.comm import base\n"),
    "the wire frames bytes": ("smolnet/wire.py", "\nfrom smoltrain.comm import socket_comm\n"),
    "the transport never imports the planner": ("smoltrain/comm/_probe.py", "import smoltrain.planner.traffic\n"),
    "the wire layout is torch-free": ("smoltrain/comm/layout.py", "\nimport torch\n"),
}


def lint_imports(cwd: Path, *extra: str) -> subprocess.CompletedProcess:
    tool = BIN / "lint-imports"
    if not tool.exists():
        pytest.fail(f"{tool} is missing: run `make setup` (import-linter is a dev dependency)")
    env = dict(os.environ, PYTHONPATH=str(cwd))
    return subprocess.run(
        [str(tool), "--no-cache", "--config", str(cwd / "pyproject.toml"), *extra],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _copy_tree(dst: Path) -> Path:
    for pkg in ("smolnet", "smoltrain"):
        shutil.copytree(ROOT / pkg, dst / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.json"))
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")
    return dst


def test_import_contracts_hold_on_the_tree():
    p = lint_imports(ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "7 kept, 0 broken" in p.stdout


def test_each_contract_breaks_when_a_forbidden_import_is_added(tmp_path):
    tree = _copy_tree(tmp_path)
    for path, line in CONTRACTS.values():
        with open(tree / path, "a") as f:
            f.write(line)
    p = lint_imports(tree)
    out = p.stdout
    assert p.returncode != 0, out[-3000:]
    for name in CONTRACTS:
        line = next((ln for ln in out.splitlines() if ln.startswith(name)), None)
        assert line and " BROKEN" in line and " KEPT" not in line, (name, out[-3000:])
    assert "smolnet._probe -> smoltrain.run.config" in out  # the copy was analysed, not the tree


def test_one_forbidden_import_breaks_only_its_contract(tmp_path):
    tree = _copy_tree(tmp_path)
    (tree / "smoltrain/planner/_probe.py").write_text("from smoltrain.strategies import dp\n")
    p = lint_imports(tree)
    assert p.returncode != 0 and "6 kept, 1 broken" in p.stdout, p.stdout[-3000:]


def test_ruff_uses_the_project_config_and_finds_a_planted_fault(tmp_path):
    ruff = BIN / "ruff"
    if not ruff.exists():
        pytest.fail(f"{ruff} is missing: run `make setup` (ruff is a dev dependency)")
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n")
    p = subprocess.run(
        [str(ruff), "check", "--config", str(ROOT / "pyproject.toml"), "--output-format", "concise", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 1 and "F401" in p.stdout, p.stdout + p.stderr
    good = tmp_path / "good.py"
    good.write_text('"""Fine."""\n')
    p = subprocess.run(
        [str(ruff), "check", "--config", str(ROOT / "pyproject.toml"), str(good)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stdout + p.stderr


def test_make_lint_runs_every_gate():
    text = (ROOT / "Makefile").read_text()
    lint = text.split("\nlint:", 1)[1].split("\n\n", 1)[0]
    for gate in ("ruff check", "ruff format --check", "lint-imports", "ansible-lint", "--syntax-check"):
        assert gate in lint, gate


def test_ansible_roles_own_their_checks_and_keep_no_duplicates():
    import yaml

    roles = ROOT / "playbooks" / "roles"
    plays = yaml.safe_load((ROOT / "playbooks" / "verify.yml").read_text())
    imported = [t["ansible.builtin.import_role"] for p in plays for t in p["tasks"]]
    assert all(i["tasks_from"] == "verify" for i in imported)
    for name in ("hostname", "ssh_mesh", "mtu", "smolcluster", "nfs_client"):
        assert (roles / name / "tasks" / "verify.yml").exists(), name
        assert name in [i["name"] for i in imported], f"playbooks/verify.yml does not run {name}'s checks"
    for role in roles.iterdir():
        texts = [p.read_text() for p in sorted((role / "vars").glob("*.yml"))]
        assert len(set(texts)) == len(texts), f"{role.name}: two vars files say the same thing"
        assert (role / "meta" / "argument_specs.yml").exists(), f"{role.name}: no argument specs"
        for h in yaml.safe_load((role / "handlers" / "main.yml").read_text()) or []:
            assert h.get("failed_when") is not False, f"{role.name}: handler '{h['name']}' hides its errors"
