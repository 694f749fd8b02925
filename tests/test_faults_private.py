"""Issue 41, private state: a host's `smol_python: ~/.local/...` (as the shipped group_vars say)
starts ranks and agents, `~` being the home of the user they run as; their logs go to a folder
only that user can enter, never to a predictable name in a shared /tmp."""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import sys
import time
from pathlib import Path

import pytest
from infer_models import make_checkpoint
from ports import free_port

from smolnet import agent_client as control
from smolnet.inventory import Host
from smolnet.launcher import ProcessGroup
from smolnet.remote import LOG_HOME, RemoteError
from smoltrain.infer.cluster import Cluster
from smoltrain.infer.config import InferConfig
from smoltrain.run.controller import Placement

SECRET = b"test-secret-0123456789abcdef"


@pytest.fixture
def tilde_python():
    """This venv's python named `~/<folder>/venv/bin/python`, through a link under $HOME (removed after)."""
    folder = f".smolcluster-test-{secrets.token_hex(4)}"
    d = Path.home() / folder
    d.mkdir(mode=0o700)
    try:
        (d / "venv").symlink_to(sys.prefix, target_is_directory=True)
        python = f"~/{folder}/venv/{Path(sys.executable).relative_to(sys.prefix)}"
        assert os.path.exists(os.path.expanduser(python))
        yield python
    finally:
        shutil.rmtree(d)


def _private(path: Path) -> None:
    st = path.parent.stat()
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid(), oct(st.st_mode)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and not path.parent.is_symlink()


def test_an_agent_starts_through_a_tilde_python_and_logs_privately(tilde_python):
    """The detached start a remote host gets (smolnet.remote's shell script), on a local host."""
    port = free_port("127.0.0.25")
    host = Host("tilde", "127.0.0.1", "127.0.0.25", local=True, python=tilde_python)
    argv = [host.python, "-m", "smolnet", "agent", "--bind", "127.0.0.25", "--port", str(port), "--secret-stdin"]
    log = f"{LOG_HOME}/smolcluster-test-{secrets.token_hex(4)}.log"
    g = ProcessGroup(SECRET)
    try:
        g.start("tilde", argv, host=host, log=log, fresh=True)
        deadline = time.monotonic() + 30
        while True:
            try:
                assert control.call("127.0.0.25", port, SECRET, "ping", timeout=5)["ok"]
                break
            except control.AgentError as e:
                assert time.monotonic() < deadline, f"{e}; log: {g.log_tail('tilde')}"
                time.sleep(0.2)
        assert g.logs["tilde"] == os.path.expanduser(log)
        _private(Path(g.logs["tilde"]))
    finally:
        g.stop()
        Path(os.path.expanduser(log)).unlink(missing_ok=True)


def test_an_inference_rank_starts_through_a_tilde_python(tilde_python, tmp_path):
    """A rank on a local inventory host: a child of the controller, `~` expanded as its shell would."""
    model = make_checkpoint(str(tmp_path / "llama"), "llama", layers=1)
    host = Host("tilde", "127.0.0.1", "127.0.0.1", local=True, python=tilde_python)
    cfg = InferConfig("local", "socket", model, None, ("rank0",), ((0, 1),))
    log_dir = tmp_path / "logs"
    log_dir.mkdir(mode=0o700)
    c = Cluster(cfg, [Placement("rank0", "127.0.0.1", host)], SECRET, str(log_dir))
    try:
        c.start(timeout=60.0)
        assert c.stats()[0]["stats"] is not None
    finally:
        c.close()
    _private(log_dir / "rank0.log")


def test_a_log_folder_that_is_a_link_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "logs").symlink_to(tmp_path / "elsewhere")  # planted by someone who could write there
    host = Host("h", "127.0.0.1", "127.0.0.1", local=True)
    g = ProcessGroup(SECRET)
    try:
        with pytest.raises(RemoteError, match="not a private folder"):
            g.start("h", [sys.executable, "-c", "pass"], host=host, log=str(tmp_path / "logs" / "h.log"))
    finally:
        g.stop()
    assert not list((tmp_path / "elsewhere").iterdir())


def test_a_link_planted_at_a_checkpoint_temp_name_is_not_written_through(tmp_path):
    """A shared (NFS) checkpoint folder: whoever can write there may plant the temp names."""
    import torch

    from smoltrain.run import checkpoint

    root = tmp_path / "ck"
    d = checkpoint.step_dir(root, 2)
    d.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("keep")
    for name in ("rank0.safetensors", "complete.json"):
        (d / f"{name}.tmp{os.getpid()}").symlink_to(victim)
    digest = checkpoint.save_part(root, 2, "rank0", {"w": torch.ones(2)})
    checkpoint.mark_complete(root, 2, {}, {"rank0": digest})
    assert victim.read_text() == "keep"
    assert not any(p.is_symlink() for p in d.iterdir())
    assert checkpoint.latest(root, None).step == 2
