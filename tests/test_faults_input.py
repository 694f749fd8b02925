"""Issue 15, defect 9, and issue 27: options and files that ended in a traceback or were silently
accepted stop the command before anything starts, with one line and exit 2: every size, count,
rate and probability of run, plan, generate, serve, calibrate and bench (smoltrain.validate)."""

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
        ("--checkpoint-every", "-1", "0 or more"),
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


def test_a_control_port_in_use_is_one_line_and_a_failed_report(capsys, tmp_path, secret_file):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        argv = ["run", "--strategy", "dp", "--local", "1", "--steps", "1", "--control-port", port]
        rc, err = one_line_error(
            capsys, [*argv, "--secret-file", secret_file, "--out", str(tmp_path), "--json", str(tmp_path / "r.json")]
        )
    assert rc == 2 and f"--control-port {port}: cannot listen" in err, err
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["status"] == "failed" and "cannot listen" in doc["error"] and doc["steps"] == []


def test_world_readable_secret_is_refused(capsys, tmp_path):
    p = tmp_path / "secret"
    p.write_text(secrets.token_hex(32))
    os.chmod(p, 0o644)
    rc, err = one_line_error(
        capsys,
        ["run", "--strategy", "dp", "--local", "1", "--steps", "1", "--secret-file", str(p), "--out", str(tmp_path)],
    )
    assert rc == 2 and "0644" in err and "chmod 600" in err, err


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


# --- every numeric option, every command: zero, negative, NaN, infinite, absurdly large ---
BASE = {
    "run": ["run", "--strategy", "dp"],
    "plan": ["plan", "--strategy", "dp"],
    "generate": ["generate", "--model", "/nonexistent", "--prompt-ids", "1"],
    "serve": ["serve", "--model", "/nonexistent"],
    "calibrate": ["calibrate", "--local"],
    "bench": ["bench", "allreduce", "--bytes", "4K"],
}
# options where 0 means something (any free port, no pace, greedy, only at the end, no warm-up, no queue)
ZERO_OK = {"--checkpoint-every", "--pace", "--control-port", "--seed", "--warmup", "--rank", "--port", "--temperature"}
ZERO_OK |= {
    "--eval-every",
    "--outer-momentum",
    "--max-queue",
    "--lora-dropout",
}  # no held-out loss; plain averaging; no queue; no dropout
BAD = ["-1", "nan", "inf", "-inf", "1e300", "99999999999999", "12abc"]


def _numeric_options(command: str) -> list[tuple[str, object]]:
    """(option, type) of every option of the command whose value is a number."""
    import argparse

    from smolnet.cli_dispatch import OneLineParser
    from smoltrain.cli import COMMANDS
    from smoltrain.validate import _Check

    module = __import__(COMMANDS[command][0], fromlist=["add_arguments"])
    p = OneLineParser(prog=f"smoltrain {command}")
    module.add_arguments(p)
    out = []
    for a in p._actions:
        if isinstance(a, argparse._HelpAction) or not a.option_strings:
            continue
        if a.type in (int, float) or isinstance(a.type, _Check):
            out.append((a.option_strings[-1], a.type))
    return out


@pytest.mark.parametrize("command", sorted(BASE))
def test_every_numeric_option_is_range_checked(command):
    """A new option with a bare int/float type fails here: plug it into smoltrain.validate."""
    from smoltrain.validate import _Check

    opts = _numeric_options(command)
    assert opts, command
    bare = [o for o, t in opts if not isinstance(t, _Check)]
    assert not bare, f"{command}: {bare} take numbers without a range (use smoltrain.validate)"


@pytest.mark.parametrize("command", sorted(BASE))
def test_bad_sizes_are_one_line_and_exit_2(capsys, command):
    for opt, _ in _numeric_options(command):
        for value in BAD + ([] if opt in ZERO_OK else ["0"]):
            rc = main([*BASE[command], f"{opt}={value}"])
            err = capsys.readouterr().err.strip()
            assert rc == 2 and err.count("\n") == 0 and opt in err and "must be" in err, (opt, value, err)


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--strategy", "dp", "--seq", "0"],
        ["plan", "--strategy", "syncps", "--seq", "0"],
        ["run", "--strategy", "dp", "--local", "1", "--seq", "0"],
        ["run", "--strategy", "syncps", "--local", "2", "--seq", "0"],
    ],
)
def test_seq_0_is_an_input_error_not_a_traceback(capsys, argv):
    rc, err = one_line_error(capsys, argv)
    assert rc == 2 and "--seq" in err and "at least 1" in err, err
