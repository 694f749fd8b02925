"""Serving's parts, in process: streamed text that never splits a character and stops at stop
strings, strict JSON and number checks, the continuous-batching scheduler (slots, lanes, joins,
leaves, cancels), chat template lookup, and `plan --mode serve` (its arithmetic and its command)."""

from __future__ import annotations

import json
import threading

import pytest
from infer_models import LLAMA3_TEMPLATE, make_bytelevel_tokenizer

from smoltrain.infer.api import BadRequest, parse_json
from smoltrain.infer.batching import DECODE, PREFILL, Batcher, Request, lead
from smoltrain.infer.textstream import TextStream


@pytest.fixture(scope="module")
def tok():
    return make_bytelevel_tokenizer()


TEXT = "Hello é ü 日本 🙂 the lazy dog."


def test_stream_never_splits_a_character_and_joins_to_the_text(tok):
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    assert any("\ufffd" in tok.decode([i]) for i in ids), "no token splits a character: nothing tested"
    ts = TextStream(tok)
    pieces = [ts.push(i) for i in ids] + [ts.finish()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == TEXT


@pytest.mark.parametrize("stop,want", [("日本", "Hello é ü "), ("dog", "Hello é ü 日本 🙂 the lazy "), ("zz", TEXT)])
def test_stop_strings_end_the_text_before_them(tok, stop, want):
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    ts = TextStream(tok, [stop, "never"])
    pieces = []
    for i in ids:
        pieces.append(ts.push(i))
        if ts.stopped:
            break
    pieces.append(ts.finish())
    assert "".join(pieces) == want and ts.stopped == (stop in TEXT)
    if ts.stopped:  # nothing of the stop string was ever sent
        assert all(stop[:2] not in p for p in pieces)


def test_strict_json():
    assert parse_json(b'{"a": 1.5, "b": [1, 2]}') == {"a": 1.5, "b": [1, 2]}
    for raw, words in [
        (b'{"t": NaN}', "NaN"),
        (b'{"t": -Infinity}', "-Infinity"),
        (b'{"t": 1e999}', "out of range"),
        (b"[" * 100000 + b"]" * 100000, "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"3", "JSON object"),
    ]:
        with pytest.raises(BadRequest, match=words):
            parse_json(raw)


class Echo:
    """An engine stand-in for the scheduler: a row's next token is its last input + 1."""

    def __init__(self, depth=1):
        self.depth, self.items, self.out, self.quit_called = depth, [], {}, False

    def issue(self, item):
        self.items.append(item)
        self.out[id(item)] = [ids[-1] + 1 for ids in item.ids]

    def collect(self, item):
        return self.out.pop(id(item))

    def keepalive(self):
        pass

    def quit(self):
        self.quit_called = True


def run_batcher(reqs, max_batch, lanes=1, depth=1, cancel_after=None):
    done, toks, ended = {}, {}, threading.Event()
    b = None

    def on_tokens(items):
        for rid, t in items:
            toks.setdefault(rid, []).append(t)
            if cancel_after and rid == cancel_after[0] and len(toks[rid]) == cancel_after[1]:
                b.cancel(rid)

    def on_done(rid, reason, stats):
        done[rid] = (reason, stats)
        if len(done) == len(reqs):
            ended.set()

    b = Batcher(max_batch, lanes, on_tokens, on_done)
    for r in reqs:
        b.submit(r)
    eng = Echo(depth)
    t = threading.Thread(target=lead, args=(eng, b, 0.05))
    t.start()
    assert ended.wait(30)
    b.stop()
    t.join(30)
    assert eng.quit_called and not t.is_alive()
    return eng.items, toks, done


def test_scheduler_batches_joins_and_leaves():
    reqs = [Request([10 * (i + 1)], max_new_tokens=3 + i, rid=i + 1) for i in range(3)]
    items, toks, done = run_batcher(reqs, max_batch=2)
    assert toks == {r.rid: [r.prompt_ids[0] + k for k in range(1, r.max_new_tokens + 1)] for r in reqs}
    assert all(done[r.rid][0] == "length" and done[r.rid][1]["output_ids"] == toks[r.rid] for r in reqs)
    kinds = [(it.kind, it.slots) for it in items]
    assert kinds[:3] == [(PREFILL, [0]), (PREFILL, [1]), (DECODE, [0, 1])]  # two slots: the third waits
    third = kinds.index((PREFILL, [0]), 1)  # it takes the first slot freed
    assert all(len(s) <= 2 for _, s in kinds) and kinds[third - 1] == (DECODE, [0, 1])
    assert done[3][1]["queue_s"] > 0 and done[3][1]["decode_steps"] == 4


def test_scheduler_lanes_cancel_and_end_of_sequence():
    reqs = [Request([p], max_new_tokens=50, rid=i + 1, stop_ids=[44]) for i, p in enumerate([100, 20, 30, 40])]
    items, toks, done = run_batcher(reqs, max_batch=4, lanes=2, depth=2, cancel_after=(2, 3))
    lanes = {it.lane for it in items if it.kind == DECODE}
    assert lanes == {0, 1} and all(len(it.slots) <= 2 for it in items if it.kind == DECODE)
    assert done[2][0] == "cancelled" and toks[2] == [21, 22, 23]
    assert done[4][0] == "stop" and toks[4] == [41, 42, 43, 44]  # 44: end of sequence
    assert done[1][0] == "length" and len(toks[1]) == 50


def test_chat_template_sources(tmp_path, tok):
    from smoltrain.infer.chat import Chat, ChatError

    msgs = [{"role": "user", "content": "hi"}]
    plain = Chat(str(tmp_path), tok)
    assert plain.template is None and plain.render(msgs) == "user: hi\nassistant:"
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<|begin_of_text|>"},
                "chat_template": [{"name": "default", "template": LLAMA3_TEMPLATE}],
            }
        )
    )
    named = Chat(str(tmp_path), tok)
    assert named.render(msgs).startswith("<|begin_of_text|><|start_header_id|>user")
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert Chat(str(tmp_path), tok).render(msgs) == "[hi]"  # the .jinja file wins, as in transformers
    (tmp_path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatError):  # the sandbox refuses what a template must not reach
        Chat(str(tmp_path), tok).render(msgs)
    (tmp_path / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(ChatError, match="does not parse"):
        Chat(str(tmp_path), tok)


def test_serve_plan_arithmetic():
    from smoltrain.models.spec import get_model
    from smoltrain.planner import capacity, serve
    from smoltrain.planner.links import from_class
    from smoltrain.planner.ranks import resolve_ranks
    from smoltrain.planner.traffic import STEP_HEADER_BYTES, TOKEN_ID_BYTES

    assert serve.split_evenly(5, 2) == [[0, 1, 2], [3, 4]]
    assert serve.split_by_speed([4.0, 1.0, 1.0, 4.0], 2) == [[0, 1], [2, 3]]
    assert serve.split_counts(10, 4) == [3, 3, 2, 2]
    from smoltrain.models.stage import MIN_ROWS

    assert serve.PAD_ROWS == MIN_ROWS

    class H:
        def __init__(self, n, dev="mac-mini-m4"):
            self.name, self.device, self.local, self.link_rate_mbit, self.vars = n, dev, False, None, {}

    ranks = resolve_ranks(4, [H(f"m{i}") for i in range(4)], None)
    m = get_model("llama-3.2-1b")
    doc = serve.plan(m, ranks, from_class("10gbe"), dtype="bf16", concurrency=16, max_batch=4, seq=256)
    by = {c["name"]: c for c in doc["candidates"]}
    # one host decodes 4 at a time, weight-read bound: a step reads its weights and 4 KV caches
    (w,) = capacity.layout("pp", "infer", m, 1, 1, 256)
    kv = 2 * w.layers * m.kv_dim * 256 * 2
    step = (w.matmul_params * 2 + 4 * kv) / ranks[0].device.mem_bw
    assert by["best host"]["latency_s_per_token"] == pytest.approx(step)
    assert by["best host"]["tokens_per_s"] == pytest.approx(4 / step)
    assert by["4 replicas"]["tokens_per_s"] == pytest.approx(4 * by["best host"]["tokens_per_s"])
    assert doc["best"] == "4 replicas"
    # a split over 2 hosts serving 2 rows: one lane per stage; a hop is two messages (the step's
    # header, then the hidden states: infer/pp.py), the way back one (the token ids)
    lm, names = from_class("10gbe"), ["m0", "m1"]
    works = capacity.layout("pp", "infer", m, 2, 1, 256)
    t = [serve._rank_seconds(w, m, rk, "pp", "bf16", 1, 256, serve.PAD_ROWS)[0] for w, rk in zip(works, ranks)]
    ln = lm.get("m0", "m1")
    there = 2 * ln.alpha_s + (m.hidden * 2 + STEP_HEADER_BYTES) / ln.bytes_per_s
    back = ln.alpha_s + TOKEN_ID_BYTES / ln.bytes_per_s
    got = serve.group_step(m, ranks[:2], names, lm, "pp", "bf16", 2, 256)
    assert got["lanes"] == 2 and got["step_s"] == pytest.approx(max(sum(t) + there + back, 2 * max(t)))
    # 8B in fp32 (32 GB) fits no 16 GB Mac alone: only the split serves it
    big = serve.plan(get_model("llama-3.1-8b"), ranks, from_class("10gbe"), concurrency=4, seq=256)
    by = {c["name"]: c for c in big["candidates"]}
    assert big["best"] == "split" and not by["best host"]["fits"] and by["best host"]["tokens_per_s"] == 0


def test_plan_mode_serve_command(tmp_path, capsys):
    from smoltrain.cli import main
    from smoltrain.schema import check_any

    out = tmp_path / "serve.json"
    argv = ["plan", "--mode", "serve", "--model", "tiny", "--world", "3", "--link-class", "1gbe", "--json", str(out)]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    check_any(doc)
    assert {c["name"] for c in doc["candidates"]} == {"split", "2 replicas", "3 replicas", "best host"}
    assert f"best here: {doc['best']}" in capsys.readouterr().out
    assert main(["plan", "--mode", "serve", "--strategy", "dp", "--model", "tiny"]) == 2
    assert "pp or tp" in capsys.readouterr().err


def test_serve_pp_group_balances_its_stages():
    """With a lane per stage in flight, a pp group's round is `lanes` times its slowest stage,
    so serve cuts the layers to balance the stages (batch-1 decode sums them: it piles layers
    on the fastest host), and `plan --mode serve` plans the very cut serve runs."""
    import itertools
    from dataclasses import replace
    from types import SimpleNamespace

    from smoltrain.infer.report import decode_request
    from smoltrain.models.spec import get_model
    from smoltrain.planner import serve
    from smoltrain.planner.links import from_class
    from smoltrain.planner.placement_plan import Ask, search
    from smoltrain.planner.ranks import resolve_ranks
    from smoltrain.planner.request import build_plan

    class H:
        def __init__(self, n, dev):
            self.name, self.device, self.local, self.link_rate_mbit, self.vars = n, dev, False, None, {}

    hosts = [H("jet", "jetson-orin-nano"), H("mini", "mac-mini-m4"), H("lap", "rtx4050-laptop")]
    ranks, lm, m = resolve_ranks(3, hosts, None), from_class("1gbe"), get_model("gpt2-124m")
    one = search(Ask("pp", "auto", m, ranks, lm, "infer", "fp32", 1, 256))
    a = Ask("pp", "auto", m, ranks, lm, "infer", "fp32", 1, 256, lanes=3)
    three = search(a)
    by = {rk.name: rk for rk in ranks}

    def stages(order, layers):  # each stage's compute and its hops, as the cut's search charges them
        n = len(order)
        out = []
        for r, (name, (lo, hi)) in enumerate(zip(order, layers)):
            w = serve.capacity.stage_work(m, r, n, hi - lo, "infer", 1, 256, 1, False)
            hop = sum(a.link_s(name, order[j], m.hidden * 4) for j in (r - 1, r + 1) if 0 <= j < n)
            out.append(a.seconds(by[name], w) + hop)
        return out

    assert max(stages(three.order, three.layers)) < max(stages(one.order, one.layers))
    # no cut of these layers in this order has a quicker slowest stage
    best = min(
        max(stages(three.order, [[lo, hi] for lo, hi in zip((0,) + c, c + (m.layers,))]))
        for c in itertools.combinations(range(1, m.layers), 2)
    )
    assert max(stages(three.order, three.layers)) == pytest.approx(best)
    # serve's run (decode_request, lanes from --max-batch) and its plan cut alike
    mc = SimpleNamespace(spec=lambda: m, ctx=4096, dtype="fp32")
    args = SimpleNamespace(strategy="pp", dtype="fp32", placement="auto", max_batch=8, links=None, compute=False)
    req = replace(decode_request(args, mc, 3, hosts, 256), link_class="1gbe")
    assert req.lanes == 3 and decode_request(replace_ns(args, max_batch=2), mc, 3, hosts, 256).lanes == 2
    ran = build_plan(req)["placement"]
    got = serve.group_step(m, ranks, [h.name for h in hosts], lm, "pp", "fp32", 8, 256, placement="auto")
    assert (got["order"], got["layers"]) == (ran["order"], ran["layers"]) == (three.order, three.layers)
    generate = SimpleNamespace(**{k: v for k, v in vars(args).items() if k != "max_batch"})  # one request
    assert decode_request(generate, mc, 3, hosts, 256).lanes == 1


def replace_ns(ns, **kw):
    from types import SimpleNamespace

    return SimpleNamespace(**{**vars(ns), **kw})
