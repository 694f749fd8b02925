"""`generate --mesh pp=2,tp=2` (issue 38): pipeline stages whose layers are tp-split, token for
token what transformers' greedy generation gives, on both transports and both axis orders, with
the bytes each link carries counted by hand; and a one-line error (exit 2) for each bad mesh."""

from __future__ import annotations

import json

import pytest
from infer_models import checkpoints

from smoltrain.cli import main

PROMPT = [3, 5, 7, 9, 11]
NEW = 8
H = 32 * 4  # one fp32 hidden state of the tiny models
HEADER = 32


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return checkpoints(tmp_path_factory.mktemp("hf"), PROMPT, NEW)


def generate(tmp_path, model: str, *extra) -> dict:
    out = tmp_path / "gen.json"
    ids = ",".join(map(str, PROMPT))
    argv = ["generate", "--model", model, "--prompt-ids", ids, "--max-new-tokens", str(NEW), "--ignore-eos"]
    assert main([*argv, "--json", str(out), "--local", "4", *extra]) == 0
    return json.loads(out.read_text())


def test_pp_x_tp_matches_transformers_and_counts_its_bytes(models, tmp_path):
    path, want = models["llama"]
    doc = generate(tmp_path, path, "--mesh", "pp=2,tp=2")
    assert doc["output_ids"] == want and len(set(want)) > 2
    assert doc["mesh"]["hosts"] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert doc["placement"]["layers"] == [[0, 2], [0, 2], [2, 3], [2, 3]]
    planned = {(x["src"], x["dst"]): x["bytes"] for x in doc["plan"]["links"]}  # per decode step
    steps = NEW - 1
    sent = {(x["src"], x["dst"]): x["bytes"] for x in doc["links"]}
    # stage 0 (rank0, rank1): rank 0 broadcasts the header (and a decode row's last token, 8 bytes),
    # then 2 layers x 2 all-reduces of 2 ranks, each rank sending one hidden state per all-reduce
    assert sent[("rank0", "rank1")] == HEADER + 4 * len(PROMPT) * H + steps * (HEADER + 8 + 4 * H)
    assert sent[("rank1", "rank0")] == 4 * (len(PROMPT) + steps) * H
    # one hop between the stages' doors (rank0 -> rank2): the header and one hidden state per token
    assert sent[("rank0", "rank2")] == (1 + steps) * HEADER + (len(PROMPT) + steps) * H
    assert ("rank1", "rank3") not in sent and ("rank3", "rank1") not in sent
    # stage 1: rank 2 hands header and hidden states to rank 3; 1 layer x 2 all-reduces
    assert sent[("rank2", "rank3")] == (1 + steps) * HEADER + 3 * (len(PROMPT) + steps) * H
    assert sent[("rank2", "rank0")] == NEW * 8  # the sampled ids back
    # the busiest rank (rank 0): header and token to its tp peer, 4 all-reduces, the hop
    assert doc["decode"]["bytes_per_token"] == HEADER + 8 + 4 * H + HEADER + H == doc["plan"]["bytes_per_token"]
    prefill = {("rank0", "rank1"): HEADER + 4 * len(PROMPT) * H, ("rank1", "rank0"): 4 * len(PROMPT) * H}
    prefill |= {("rank0", "rank2"): HEADER + len(PROMPT) * H, ("rank2", "rank3"): HEADER + 3 * len(PROMPT) * H}
    prefill |= {("rank3", "rank2"): 2 * len(PROMPT) * H, ("rank2", "rank0"): 8}
    assert {k: (n - prefill[k]) / steps for k, n in sent.items()} == planned  # the plan's, link by link


def test_tp_outer_on_torch_gpt2(models, tmp_path):
    """Axes in the other order (tp outermost): rank 1 is stage 1's door; gloo groups carry it."""
    path, want = models["gpt2"]
    doc = generate(tmp_path, path, "--mesh", "tp=2,pp=2", "--backend", "torch")
    assert doc["output_ids"] == want
    assert doc["placement"]["layers"] == [[0, 2], [2, 3], [0, 2], [2, 3]]


def one_line_error(capsys, argv) -> str:
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0, err
    return err


@pytest.mark.parametrize(
    "mesh,says",
    [
        ("pp=3,tp=2", "multiply to 6 ranks, the world has 4"),
        ("pp=1,tp=4", "tp=4 is wider than"),  # the Llama has 2 KV heads
        ("dp=2,tp=2", "pp and tp only, not dp"),
        ("pp=2,tp=x", "not AXIS=N"),
    ],
)
def test_bad_mesh(models, capsys, mesh, says):
    path = models["llama"][0]
    err = one_line_error(capsys, ["generate", "--model", path, "--prompt-ids", "1", "--local", "4", "--mesh", mesh])
    assert says in err


def test_serve_bad_mesh(models, capsys):
    argv = ["serve", "--model", models["llama"][0], "--local", "6", "--mesh", "pp=2,tp=2", "--api-key", "k"]
    assert "6 ranks are not whole meshes of 4 ranks" in one_line_error(capsys, argv)


def test_serve_mesh_batches_and_answers_as_the_reference(tmp_path):
    """serve --mesh pp=2,tp=2 over 8 ranks: 2 replicas, each a mesh; four greedy completions at once
    get what each gets alone, and what the one-process reference answers."""
    import threading

    import servetools
    from infer_models import make_chat_checkpoint

    path = make_chat_checkpoint(str(tmp_path / "chat"))
    prompts = ["Hello there", "The cat sat", "one two three", "smol cluster"]
    servers = {
        "local": servetools.start(path, "--strategy", "local", key="k"),
        "mesh": servetools.start(path, "--mesh", "pp=2,tp=2", "--local", "8", key="k"),
    }
    try:

        def ask(kind, q):
            r = servers[kind]["client"].completions.create(
                model="chat", prompt=q, max_tokens=NEW, temperature=0.0, extra_body={"ignore_eos": True}
            )
            return r.choices[0].model_extra["token_ids"]

        want = [ask("local", q) for q in prompts]
        assert [ask("mesh", q) for q in prompts] == want and len({tuple(w) for w in want}) == len(want)
        assert len(servers["mesh"]["setups"]) == 2 and all(s.cfg.mesh == "pp=2,tp=2" for s in servers["mesh"]["setups"])
        got: dict = {}
        ts = [threading.Thread(target=lambda i=i: got.__setitem__(i, ask("mesh", prompts[i]))) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert [got[i] for i in range(4)] == want
    finally:
        for s in servers.values():
            servetools.stop(s)
