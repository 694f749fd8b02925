"""One error hierarchy: every exception class defined in smolnet and smoltrain derives from
SmolError, so the command line reports each as one line with a chosen exit status."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import smolnet
import smoltrain
from smolnet.errors import SmolError, UsageError

ROOT = Path(__file__).resolve().parent.parent


def _modules():
    for pkg in (smolnet, smoltrain):
        yield pkg.__name__
        for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if not m.name.endswith("__main__"):  # importing it would run the CLI
                yield m.name


def _exception_classes():
    found = []
    for name in _modules():
        mod = importlib.import_module(name)
        for _, obj in inspect.getmembers(mod, inspect.isclass):
            if obj.__module__ == name and issubclass(obj, BaseException):
                found.append(obj)
    return found


def test_every_exception_class_in_the_packages_is_a_smol_error():
    classes = _exception_classes()
    assert len(classes) >= 10, classes  # the walk found the packages' errors at all
    outside = [f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, SmolError)]
    assert outside == [], f"exception classes outside smolnet.errors.SmolError: {outside}"


def test_no_exception_class_hides_in_a_function_or_an_unimported_file():
    """Classes defined inside functions are invisible to the import walk: check the source too."""
    bad = []
    for path in sorted((ROOT / "smolnet").rglob("*.py")) + sorted((ROOT / "smoltrain").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                builtin = {"Exception", "BaseException", "RuntimeError", "ValueError", "OSError", "KeyError"}
                if bases & builtin and (path.name, node.name) != ("errors.py", "SmolError"):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert bad == []


def test_the_check_catches_a_new_class_outside_the_hierarchy(tmp_path, monkeypatch):
    pkg = tmp_path / "smolnet_probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("class StrayError(Exception):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(smolnet, "__path__", [*smolnet.__path__, str(pkg)])
    (pkg / "stray.py").write_text("class StrayError(Exception):\n    pass\n")
    stray = [c for c in _exception_classes() if c.__name__ == "StrayError"]
    assert stray and not issubclass(stray[0], SmolError)  # the walk sees it, and it is outside


def test_messages_are_one_line_and_codes_are_kept():
    e = SmolError("first\nsecond")
    assert str(e) == "first second" and e.code == 1
    assert UsageError("x").code == 2 and SmolError("x", code=4).code == 4
    from smolnet.inventory import InventoryError
    from smolnet.remote import RemoteError

    assert InventoryError("bad").code == 2
    r = RemoteError("pi5", "exited 1:\nboom")
    assert str(r) == "pi5: exited 1: boom" and r.host == "pi5"


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--strategy", "dp", "--links", "/nonexistent/links.json"],
        ["run", "--strategy", "dp", "-i", "/nonexistent/inv.yml"],
    ],
)
def test_cli_reports_a_smol_error_in_one_line(argv, capsys):
    from smoltrain.cli import main

    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("smoltrain: error: "), err
