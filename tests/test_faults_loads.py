"""Issue 41: what a downloaded checkpoint can get wrong is refused at load, in one line, before
any rank starts: head counts the attention kernels would divide or index by, a tensor in two
shards, a complete.json whose part names leave their folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from infer_models import make_checkpoint

from smolnet.errors import SmolError
from smoltrain.cli import main
from smoltrain.run import checkpoint


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("hf") / "llama"), "llama", layers=1)


def _with_config(src: str, dst, **changes) -> str:
    """A copy of src with config changes; with new head counts its attention tensors get the
    shapes those counts give (head_dim 8), so only the counts themselves are wrong."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    if heads > 0 and kv > 0 and cfg.get("head_dim", 8) == 8:
        (st,) = dst.glob("*.safetensors")
        t = load_file(str(st))
        h = cfg["hidden_size"]
        for name in [k for k in t if "self_attn" in k]:
            rows, cols = {"q": (heads * 8, h), "k": (kv * 8, h), "v": (kv * 8, h), "o": (h, heads * 8)}[
                name.split(".")[-2][0]
            ]
            t[name] = torch.randn(rows, cols) * 0.2
        save_file(t, str(st), metadata={"format": "pt"})
    return str(dst)


@pytest.mark.parametrize(
    "changes,says",
    [
        ({"num_attention_heads": 6, "num_key_value_heads": 4, "head_dim": 8}, "4 kv heads must divide the 6"),
        ({"num_key_value_heads": 8, "head_dim": 8}, "8 kv heads must divide the 4 attention heads"),
        ({"num_attention_heads": 0}, "heads is 0"),
        ({"head_dim": -8}, "head_dim is -8"),
        ({"intermediate_size": 0}, "ffn is 0"),
    ],
)
def test_bad_head_counts_are_one_line_and_exit_2(llama, tmp_path, capsys, changes, says):
    model = _with_config(llama, tmp_path / "bad", **changes)
    rc = main(["generate", "--local", "1", "--model", model, "--prompt-ids", "1,2", "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and says in err, err
    assert "rank" not in err  # refused by the controller, not by a rank that started


def test_the_cli_exits_2_before_starting_a_rank(llama, tmp_path):
    model = _with_config(llama, tmp_path / "bad", num_attention_heads=6, num_key_value_heads=4, head_dim=8)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    p = subprocess.run(
        [sys.executable, "-m", "smoltrain", "generate", "--local", "1", "--model", model] + ["--prompt-ids", "1,2"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, TMPDIR=str(tmp)),
    )
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert not list(tmp.iterdir())  # the ranks' log folder was never made: none started


def test_a_tensor_in_two_shards_is_refused(llama, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    model = tmp_path / "twice"
    shutil.copytree(llama, model)
    (st,) = model.glob("*.safetensors")
    tensors = load_file(str(st))
    name = "model.layers.0.mlp.up_proj.weight"
    save_file({name: torch.zeros_like(tensors[name])}, str(model / "zz-extra.safetensors"), metadata={"format": "pt"})
    rc = main(["generate", "--local", "1", "--model", str(model), "--prompt-ids", "1,2", "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and f"tensor {name} is also in" in err, err


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_a_part_name_that_leaves_its_folder_is_refused(tmp_path, where):
    root = tmp_path / "ckpt"
    digest = checkpoint.save_part(root, 4, "rank0", {"w": torch.ones(4)})
    d = checkpoint.step_dir(root, 4)
    shutil.copy(d / "rank0.safetensors", tmp_path / "evil.safetensors")  # matches the digest
    part = "../../evil" if where == "parent" else str(tmp_path / "evil")
    checkpoint.mark_complete(root, 4, {}, {part: digest})
    with pytest.raises(SmolError, match="not a plain file name"):
        checkpoint.latest(root, None)
    with pytest.raises(SmolError, match="not a plain file name"):
        checkpoint.load_part(root, 4, part)
