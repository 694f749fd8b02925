"""Issue 15, defect 9: options and files that ended in a traceback or were silently accepted
now stop the run before anything starts, with one line and exit 2 (a readable secret: 1)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

import pytest

from smoltrain.cli import main


def one_line_error(capsys, argv) -> tuple[int, str]:
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    return rc, err


def _links(tmp_path, kind: str) -> str:
    p = tmp_path / "links.json"
    if kind == "truncated":
        p.write_text('{"schema": "smolnet.links/1", "links": [{"src": "a", "dst"')
    elif kind == "string":
        p.write_text(json.dumps({"schema": "smolnet.links/1", "links": "fast"}))
    else:
        return str(tmp_path / "absent.json")
    return str(p)


@pytest.mark.parametrize(
    "kind,want", [("truncated", "not valid JSON"), ("string", "'links' must be a list"), ("missing", "no such file")]
)
def test_bad_links_file(capsys, tmp_path, secret_file, kind, want):
    rc, err = one_line_error(
        capsys,
        [
            "run",
            "--strategy",
            "dp",
            "--local",
            "1",
            "--steps",
            "1",
            "--links",
            _links(tmp_path, kind),
            "--secret-file",
            secret_file,
            "--out",
            str(tmp_path),
        ],
    )
    assert rc == 2 and want in err, err


@pytest.mark.parametrize(
    "opt,value,want",
    [
        ("--control-port", "99999", "1..65535"),
        ("--microbatches", "0", "at least 1"),
        ("--timeout", "0", "positive"),
        ("--checkpoint-every", "-1", "0 (only at the end) or more"),
        ("--lr", "nan", "positive finite"),
        ("--keep-checkpoints", "0", "at least 1"),
        ("--heartbeat", "0", "positive"),
    ],
)
def test_out_of_range_options(capsys, tmp_path, secret_file, opt, value, want):
    rc, err = one_line_error(
        capsys,
        ["run", "--strategy", "pp", "--local", "2", opt, value, "--secret-file", secret_file, "--out", str(tmp_path)],
    )
    assert rc == 2 and opt in err and want in err, err


def test_unwritable_json_path_fails_before_the_run(capsys, tmp_path, secret_file):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    rc, err = one_line_error(
        capsys,
        [
            "run",
            "--strategy",
            "dp",
            "--local",
            "1",
            "--steps",
            "1",
            "--json",
            str(blocker / "r.json"),
            "--secret-file",
            secret_file,
            "--out",
            str(tmp_path),
        ],
    )
    assert rc == 2 and "--json" in err and "not a folder" in err, err


def test_world_readable_secret_is_refused(capsys, tmp_path):
    p = tmp_path / "secret"
    p.write_text(secrets.token_hex(32))
    os.chmod(p, 0o644)
    rc, err = one_line_error(
        capsys,
        ["run", "--strategy", "dp", "--local", "1", "--steps", "1", "--secret-file", str(p), "--out", str(tmp_path)],
    )
    assert rc == 1 and "0644" in err and "chmod 600" in err, err


def test_secret_init_reports_the_real_mode(tmp_path):
    p = tmp_path / "secret"
    p.write_text(secrets.token_hex(32))
    os.chmod(p, 0o644)
    r = subprocess.run(
        [sys.executable, "-m", "smolnet", "secret", "init", "--secret-file", str(p)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "0644" in r.stderr and "0600" not in r.stdout, r.stdout + r.stderr
    os.chmod(p, 0o600)
    r = subprocess.run(
        [sys.executable, "-m", "smolnet", "secret", "init", "--secret-file", str(p)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and "(mode 0600)" in r.stdout
