"""`smoltrain generate` end to end: token for token what transformers' greedy generation gives,
for the one-process reference, pp over 2 and 3 ranks (3 layers: uneven stages) and tp over 2,
Llama (grouped-query attention) and GPT-2; and a clear one-line error for each bad input."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest
from infer_models import checkpoints

from smoltrain.cli import main

PROMPT = [3, 5, 7, 9, 11]
NEW = 10


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return checkpoints(tmp_path_factory.mktemp("hf"), PROMPT, NEW)


def generate(tmp_path, model: str, *extra) -> dict:
    out = tmp_path / "gen.json"
    rc = main(
        [
            "generate",
            "--model",
            model,
            "--prompt-ids",
            ",".join(map(str, PROMPT)),
            "--max-new-tokens",
            str(NEW),
            "--ignore-eos",
            "--json",
            str(out),
            *extra,
        ]
    )
    assert rc == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_local_matches_transformers(models, tmp_path, arch):
    path, want = models[arch]
    doc = generate(tmp_path, path, "--strategy", "local")
    assert doc["schema"] == "smoltrain.generate/1"
    assert doc["output_ids"] == want
    assert len(set(want)) > 2, "a degenerate reference would not test much"
    assert doc["world_size"] == 1 and doc["links"] == []


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("strategy,world", [("pp", 2), ("pp", 3), ("tp", 2)])
def test_split_matches_transformers(models, tmp_path, arch, strategy, world, monkeypatch):
    path, want = models[arch]
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # where the ranks' log folder goes
    doc = generate(tmp_path, path, "--strategy", strategy, "--local", str(world))
    assert doc["output_ids"] == want
    left = list(tmp.iterdir())  # a clean run leaves no log folder behind; if it does, show why
    assert left == [], {str(f): f.read_text()[-2000:] for d in left for f in sorted(d.iterdir())}
    h, a = 32, 4
    steps = NEW - 1
    assert doc["decode"]["tokens"] == steps
    if strategy == "pp":
        assert doc["placement"]["layers"] == ([[0, 2], [2, 3]] if world == 2 else [[0, 1], [1, 2], [2, 3]])
        want_bpt = h * a + 32  # one hidden state per hop and the step's header; the token id back is 8 bytes
    else:
        want_bpt = 2 * 3 * h * a * 2 * (world - 1) / world + 32  # 2 ring all-reduces per layer; the header
    assert doc["decode"]["bytes_per_token"] == want_bpt
    assert doc["plan"]["bytes_per_token"] == pytest.approx(want_bpt, rel=0.02)
    # each rank's decode terms count its comm calls per token: pp's rank 0 sends the header and
    # the hidden state and receives the token; a middle stage receives two and sends two; the
    # last receives two and sends the token. tp: 2 all-reduces a layer, and rank 0's header
    calls = {name: r["messages"] for name, r in doc["decode"]["per_rank"].items()}
    if strategy == "pp":
        assert calls == {f"rank{r}": (3 if r in (0, world - 1) else 4) for r in range(world)}
    else:
        assert calls == {f"rank{r}": 2 * 3 + (r == 0) for r in range(world)}
        # the plan counts the messages the transport sends: two ranks swap each small all-reduce
        # whole, one message a call (a plan of the ring's two rounds charged twice the latency)
        planned = {ln["src"]: ln["messages_per_step"] for ln in doc["plan"]["links"]}
        assert planned == calls
    # the token's terms against the plan's: every rank's stage, and the rest of the token
    v = doc["decode"]["vs_plan"]
    assert [r["name"] for r in v["ranks"]] == [f"rank{r}" for r in range(world)]
    assert v["token"]["measured_s"] == pytest.approx(1 / doc["decode"]["tokens_per_s"])
    chain = sum if strategy == "pp" else max
    staged = chain(r["measured_s"] for r in v["ranks"])
    assert v["rest"]["measured_s"] == pytest.approx(max(0.0, v["token"]["measured_s"] - staged))
    sent = {(x["src"], x["dst"]): x["bytes"] for x in doc["links"]}
    if strategy == "pp":  # the prompt's hidden states, each decode step, a header each; ids back
        assert sent[("rank0", "rank1")] == (len(PROMPT) + steps) * h * a + (1 + steps) * 32
        assert sent[(f"rank{world - 1}", "rank0")] == NEW * 8


def test_a_rank_that_exits_badly_after_serving_keeps_its_logs_and_says_so(models, tmp_path, caplog):
    """A rank that answered every request, then exited non-zero on close: the answer stands, the
    log folder stays and one warning names the rank, its status and the folder (nothing silent)."""
    import sys

    from smolnet.inventory import Host
    from smoltrain.infer.batching import Request
    from smoltrain.infer.cluster import Cluster
    from smoltrain.infer.config import InferConfig
    from smoltrain.run.controller import Placement

    path, want = models["llama"]
    python = tmp_path / "python"  # the worker as usual, then a bad exit status
    python.write_text(f'#!/bin/sh\n"{sys.executable}" "$@"\nexit 3\n')
    python.chmod(0o755)
    host = Host("bad", "127.0.0.1", "127.0.0.1", local=True, python=str(python))
    cfg = InferConfig("local", "socket", path, None, ("rank0",), ((0, 3),))
    logs = tmp_path / "logs"
    logs.mkdir(mode=0o700)
    c = Cluster(cfg, [Placement("rank0", "127.0.0.1", host)], b"s" * 32, str(logs), own_logs=True)
    try:
        c.start(timeout=60.0)
        got = c.generate(Request(PROMPT, NEW, 0.0, 1.0, 0, []))
    finally:
        with caplog.at_level("WARNING", logger="smoltrain.infer"):
            c.close()
    assert got[0]["output_ids"] == want
    assert (logs / "rank0.log").exists()
    assert f"rank0 status 3); their logs: {logs}" in caplog.text


def test_torch_backend_and_sampling(models, tmp_path):
    path, want = models["llama"]
    doc = generate(tmp_path, path, "--strategy", "tp", "--local", "2", "--backend", "torch")
    assert doc["output_ids"] == want
    sampled = ["--temperature", "0.9", "--top-p", "0.9", "--seed", "7"]
    local = generate(tmp_path, path, "--strategy", "local", *sampled)["output_ids"]
    assert local != want  # sampling draws something else than greedy
    assert generate(tmp_path, path, "--strategy", "local", *sampled)["output_ids"] == local
    assert generate(tmp_path, path, "--strategy", "pp", "--local", "2", *sampled)["output_ids"] == local


def test_rounds_decode_the_same_request_again_and_count_every_round(models, tmp_path, capsys):
    """--rounds N: the same tokens each round (the text is the first's), decode tokens, seconds
    and the links' bytes over all N, each round's rate kept; prefill stays one round's."""
    path, want = models["gpt2"]
    one = generate(tmp_path, path, "--strategy", "pp", "--local", "2")
    three = generate(tmp_path, path, "--strategy", "pp", "--local", "2", "--rounds", "3")
    err = capsys.readouterr().err
    assert three["output_ids"] == want == one["output_ids"]
    d1, d3 = one["decode"], three["decode"]
    assert d1["rounds"] == 1 and d1["tokens_per_s_rounds"] == [pytest.approx(d1["tokens_per_s"])]
    assert d3["rounds"] == 3 and d3["tokens"] == 3 * d1["tokens"] == 3 * (NEW - 1)
    assert len(d3["tokens_per_s_rounds"]) == 3 and all(r > 0 for r in d3["tokens_per_s_rounds"])
    assert d3["tokens_per_s"] == pytest.approx(d3["tokens"] / d3["seconds"])
    # the whole rate lies within the rounds' (a mean of rates weighted by their time)
    assert min(d3["tokens_per_s_rounds"]) <= d3["tokens_per_s"] * (1 + 1e-9)
    assert d3["tokens_per_s"] <= max(d3["tokens_per_s_rounds"]) * (1 + 1e-9)
    assert d3["bytes_per_token"] == d1["bytes_per_token"]  # per token, the same split
    assert three["prefill"]["bytes"] == one["prefill"]["bytes"] and three["prefill"]["tokens"] == len(PROMPT)
    b1 = {(x["src"], x["dst"]): x["bytes"] for x in one["links"]}
    b3 = {(x["src"], x["dst"]): x["bytes"] for x in three["links"]}
    assert b1.keys() == b3.keys() and all(b3[k] == 3 * b1[k] for k in b1)
    assert "over 3 rounds" in err
    from smoltrain.schema import check_any

    check_any(three)


def test_text_prompt_with_tokenizer(models, tmp_path, capsys):
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tm

    path = str(tmp_path / "withtok")
    shutil.copytree(models["gpt2"][0], path)
    vocab = {w: i for i, w in enumerate(["[UNK]"] + [f"w{i}" for i in range(1, 97)])}
    tok = Tokenizer(tm.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))
    out = tmp_path / "t.json"
    assert (
        main(
            [
                "generate",
                "--strategy",
                "local",
                "--model",
                path,
                "--prompt",
                "w3 w5 w7 w9 w11",
                "--max-new-tokens",
                str(NEW),
                "--ignore-eos",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    assert doc["prompt_ids"] == PROMPT and doc["output_ids"] == models["gpt2"][1]
    assert doc["text"] == " ".join(f"w{i}" if i else "[UNK]" for i in doc["output_ids"])
    assert doc["text"] in capsys.readouterr().out.replace("\n", "")


def one_line_error(capsys, argv) -> str:
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc != 0 and err.count("\n") == 0, err
    return err


def test_bad_inputs(models, tmp_path, capsys):
    path = models["llama"][0]
    base = ["generate", "--strategy", "local", "--model"]
    err = one_line_error(capsys, base + [path, "--prompt-ids", ",".join(["1"] * 60), "--max-new-tokens", "10"])
    assert "exceed the model's context of 64" in err
    err = one_line_error(capsys, base + [path, "--prompt", "hello"])
    assert "no tokenizer.json" in err and "--prompt-ids" in err
    err = one_line_error(capsys, base + [path, "--prompt-ids", "1,200"])
    assert "outside the model's vocabulary" in err

    other = tmp_path / "bert"
    shutil.copytree(path, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(cfg, model_type="bert")))
    assert "unknown architecture 'bert'" in one_line_error(capsys, base + [str(other), "--prompt-ids", "1"])

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    (st,) = broken.glob("*.safetensors")
    tensors = load_file(str(st))
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, str(st), metadata={"format": "pt"})
    err = one_line_error(
        capsys, ["generate", "--strategy", "pp", "--local", "2", "--model", str(broken), "--prompt-ids", "1"]
    )
    assert "missing tensor model.layers.2.mlp.up_proj.weight" in err
    tensors["model.layers.2.mlp.up_proj.weight"] = tensors["model.layers.2.mlp.gate_proj.weight"][:, :16].clone()
    save_file(tensors, str(st), metadata={"format": "pt"})
    err = one_line_error(capsys, base + [str(broken), "--prompt-ids", "1"])
    assert "model.layers.2.mlp.up_proj.weight has shape [64, 16]" in err
    err = one_line_error(capsys, ["generate", "--strategy", "tp", "--local", "3", "--model", path, "--prompt-ids", "1"])
    assert "do not split evenly" in err


@pytest.mark.parametrize("strategy,world", [("pp", 3), ("tp", 2)])
def test_end_of_sequence_stops_every_rank(models, tmp_path, strategy, world):
    """Rank 0 sees the end-of-sequence token and stops the others in band; the next request still runs."""
    path, want = models["llama"]
    k = 3
    eos = want[k]
    k = want.index(eos)
    eos_dir = tmp_path / "eos"
    shutil.copytree(path, eos_dir)
    cfg = json.loads((eos_dir / "config.json").read_text())
    (eos_dir / "config.json").write_text(json.dumps(dict(cfg, eos_token_id=eos)))
    out = tmp_path / "eos.json"
    assert (
        main(
            [
                "generate",
                "--strategy",
                strategy,
                "--local",
                str(world),
                "--model",
                str(eos_dir),
                "--prompt-ids",
                ",".join(map(str, PROMPT)),
                "--max-new-tokens",
                str(NEW),
                "--json",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    assert doc["output_ids"] == want[: k + 1]
    assert doc["decode"]["tokens"] == k
    # one token only: the stop marker goes out right after prefill
    assert (
        generate(tmp_path, path, "--strategy", strategy, "--local", str(world), "--max-new-tokens", "1")["output_ids"]
        == want[:1]
    )
