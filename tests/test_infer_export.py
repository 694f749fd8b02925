"""`smoltrain export`: a trained `smoltrain run` checkpoint becomes a GPT-2 folder that transformers
loads with the same logits, and that `smoltrain generate` runs split over ranks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from smoltrain.cli import main


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "smoltrain",
            "run",
            "--strategy",
            "dp",
            "--local",
            "1",
            "--steps",
            "3",
            "--batch",
            "2",
            "--seq",
            "32",
            "--checkpoint-dir",
            str(root / "ck"),
            "--out",
            str(root),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr
    return root / "ck"


def test_export_loads_in_transformers_with_same_logits(trained, tmp_path, capsys):
    import transformers
    from safetensors.torch import load_file

    from smoltrain.models.gpt import GPT
    from smoltrain.models.spec import get_model

    out = tmp_path / "hf"
    assert main(["export", "--checkpoint-dir", str(trained), "--out", str(out)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    hf.eval()
    ours = GPT(get_model("tiny"))
    ours.load_state_dict(
        {
            k[6:]: v
            for k, v in load_file(str(trained / "step-000003" / "rank0.safetensors")).items()
            if k.startswith("param.")
        }
    )
    ours.eval()
    ids = torch.tensor([list(b"def main():")])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), atol=1e-4, rtol=1e-4)

    # and it runs split over ranks, text in (byte-level tokenizer.json), same tokens as transformers
    want = hf.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)[0, ids.shape[1] :]
    rep = tmp_path / "gen.json"
    assert (
        main(
            [
                "generate",
                "--strategy",
                "pp",
                "--local",
                "2",
                "--model",
                str(out),
                "--prompt",
                "def main():",
                "--max-new-tokens",
                "6",
                "--json",
                str(rep),
            ]
        )
        == 0
    )
    doc = json.loads(rep.read_text())
    assert doc["prompt_ids"] == list(b"def main():")
    assert doc["output_ids"] == want.tolist()
    from tokenizers import Tokenizer

    assert doc["text"] == Tokenizer.from_file(str(out / "tokenizer.json")).decode(want.tolist())


def test_export_refuses_what_it_cannot_read(tmp_path, capsys):
    rc = main(["export", "--checkpoint-dir", str(tmp_path), "--out", str(tmp_path / "o")])
    assert rc != 0 and "no complete checkpoint" in capsys.readouterr().err


def test_export_verifies_the_checkpoint_it_reads(trained, tmp_path, capsys):
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(trained / "step-000003", ck / "step-000003")
    shutil.copytree(trained / "step-000003", ck / "step-000002")  # an older intact one
    meta = json.loads((ck / "step-000002" / "complete.json").read_text())
    (ck / "step-000002" / "complete.json").write_text(json.dumps(dict(meta, step=2)))
    part = ck / "step-000003" / "rank0.safetensors"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit, same size
    part.write_bytes(bytes(data))
    assert main(["export", "--checkpoint-dir", str(ck), "--out", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    assert "skipped step-000003 (rank0.safetensors is damaged: its sha256" in err and "from step 2" in err, err
    assert json.loads((tmp_path / "o" / "config.json").read_text())["smoltrain"]["step"] == 2
    (ck / "step-000002" / "rank0.safetensors").write_bytes(b"")
    rc = main(["export", "--checkpoint-dir", str(ck), "--out", str(tmp_path / "o2")])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.count("\n") == 0 and "no intact checkpoint" in err, err
    assert not (tmp_path / "o2").exists()
