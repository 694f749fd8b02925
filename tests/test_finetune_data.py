"""`--data` for fine-tuning: our token ids and loss masks equal transformers' (chat templates with and
without generation markers, TRL's prompt/completion convention), batches depend only on seed and step,
the loss over a batch is transformers' own, and bad input is one line naming what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from finetune_models import CHATS, MARKED, PLAIN, make_finetune_checkpoint, write_jsonl

from smolnet.errors import UsageError
from smoltrain.finetune import data
from smoltrain.finetune.examples import DataError, Tokenizing


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_finetune_checkpoint(str(tmp_path_factory.mktemp("marked")), template=MARKED)


@pytest.fixture(scope="module")
def hf_tok(ckpt):
    import transformers

    return transformers.PreTrainedTokenizerFast.from_pretrained(ckpt)


def _ours(model_dir):
    from smoltrain.models.hf import load_tokenizer, read_config

    return Tokenizing(model_dir, load_tokenizer(model_dir), read_config(model_dir).eos)


def _theirs(hf_tok, chat):
    out = hf_tok.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def test_chat_ids_and_assistant_mask_equal_transformers_with_generation_markers(ckpt, hf_tok):
    t = _ours(ckpt)
    assert t.marked
    for chat in CHATS:
        ids, mask = t.chat_example(chat)
        want_ids, want_mask = _theirs(hf_tok, chat)
        assert ids == want_ids
        assert mask == want_mask
        assert 0 < sum(mask) < len(mask)  # the user's and system's tokens carry no loss


def test_a_template_without_markers_masks_each_assistant_turn_as_the_marked_one_does(ckpt, hf_tok, tmp_path):
    """PLAIN is MARKED less its markers: what each assistant turn adds after the generation prompt is
    exactly what the markers wrap, so the masks agree token for token."""
    plain = make_finetune_checkpoint(str(tmp_path / "plain"), template=PLAIN)
    t = _ours(plain)
    assert not t.marked
    for chat in CHATS:
        assert t.chat_example(chat) == _theirs(hf_tok, chat)


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    # empties every assistant turn but the last (as Qwen3 drops earlier reasoning): rendering turn by
    # turn cannot find the assistant's tokens
    rewrites = PLAIN.replace(
        "{%- if message['role'] == 'assistant' -%}",
        "{%- if message['role'] == 'assistant' and not loop.last -%}{{ '<|im_start|>assistant\\n<|im_end|>\\n' }}"
        "{%- elif message['role'] == 'assistant' -%}",
    )
    t = _ours(make_finetune_checkpoint(str(tmp_path / "rw"), template=rewrites))
    with pytest.raises(DataError, match="turn by turn"):
        t.chat_example(CHATS[0])


def test_prompt_completion_pairs_follow_trl(ckpt, hf_tok):
    t = _ours(ckpt)
    prompt, completion = "Hello there, how are", " you today?"
    ids, mask = t.pair_example(prompt, completion)
    head = hf_tok(prompt)["input_ids"]
    assert ids == hf_tok(prompt + completion + "<|im_end|>")["input_ids"]
    assert mask == [0] * len(head) + [1] * (len(ids) - len(head))
    # chat-style pairs: the prompt rendered with the generation prompt
    p, c = CHATS[0][:4], CHATS[0][4:]
    ids, mask = t.pair_example(p, c)
    head = hf_tok.apply_chat_template(p, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids == list(hf_tok.apply_chat_template(p + c, tokenize=True, return_dict=True)["input_ids"])
    assert mask == [0] * len(head) + [1] * (len(ids) - len(head))


def test_text_is_documents_joined_with_eos_in_windows_of_seq_plus_one(ckpt, hf_tok, tmp_path):
    docs = ["The quick brown fox jumps over the lazy dog. " * 3, "Hello there, how are you today? " * 4]
    folder = tmp_path / "notes"
    folder.mkdir()
    for i, d in enumerate(docs):
        (folder / f"{i}.txt").write_text(d)
    (folder / "skip.bin").write_bytes(b"\x00\x01")  # not a text suffix
    ds = data.load(str(folder), ckpt, seq=16)
    eos = hf_tok.convert_tokens_to_ids("<|im_end|>")
    stream = [i for d in docs for i in hf_tok(d)["input_ids"] + [eos]]
    assert ds.kind == "text"
    windows = [ds.example(i)[0].tolist() for i in range(len(ds))]
    assert windows == [stream[a : a + 17] for a in range(0, len(stream) - 1, 16)]
    assert all(int(ds.example(i)[1].min()) == 1 for i in range(len(ds)))
    capped = data.load(str(folder), ckpt, seq=16, cap_bytes=40)  # --data-cap-mb: the first 40 bytes only
    assert capped.example(0)[0].tolist() == (hf_tok(docs[0][:40])["input_ids"] + [eos])[:17]


def test_batches_depend_only_on_seed_and_step_and_cover_each_epoch(ckpt, tmp_path):
    rows = [{"prompt": f"Hello {'there ' * (i % 5)}", "completion": f"fox {i}"} for i in range(20)]
    ds = data.load(write_jsonl(str(tmp_path / "p.jsonl"), rows), ckpt, seq=24)
    assert ds.kind == "pairs" and len(ds) == 20
    a, b = data.Batches(ds, 4, 24, seed=3, holdout=True), data.Batches(ds, 4, 24, seed=3, holdout=True)
    for step in (7, 0, 7, 2):  # any order, any instance: the same batch
        assert all(torch.equal(u, v) for u, v in zip(a.global_batch(step), b.global_batch(step)))
    x, y = a.global_batch(5)
    assert torch.equal(a.slice(5, 1, 3)[0], x[1:3]) and torch.equal(a.slice(5, 1, 3)[1], y[1:3])
    assert a.loss_tokens(5) == int((y != -100).sum()) > 0
    assert not torch.equal(data.Batches(ds, 4, 24, seed=4).global_batch(5)[0], x)
    # 20 examples, 1 held out: the first 19*4 positions are 4 epochs of each training example once
    seen = [a._index(p) for p in range(19 * 4)]
    for e in range(4):
        assert sorted(seen[e * 19 : (e + 1) * 19]) == list(range(19))
    held = a.eval_batches()
    assert len(held) == 1  # the last example (never drawn for training, as `seen` shows)
    assert torch.equal(held[0][0][0], a.rows([19])[0][0])


def test_a_batch_row_gives_transformers_loss_on_the_example(ckpt, hf_tok, tmp_path):
    """Right padding (EOS in, -100 out) changes nothing: causal attention never looks ahead."""
    import transformers

    ds = data.load(write_jsonl(str(tmp_path / "c.jsonl"), [{"messages": c} for c in CHATS]), ckpt, seq=120)
    b = data.Batches(ds, 2, 120, seed=0)
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    for i, chat in enumerate(CHATS):
        x, y = b.rows([i])
        ids, mask = _theirs(hf_tok, chat)
        labels = torch.tensor([[t if m else -100 for t, m in zip(ids, mask)]])
        with torch.no_grad():
            want = model(input_ids=torch.tensor([ids]), labels=labels).loss
            logits = model(input_ids=x).logits
        ours = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1), ignore_index=-100)
        assert torch.allclose(ours, want, rtol=1e-5)
        assert int((y != -100).sum()) == sum(mask[1:])


def test_the_wire_form_round_trips_and_is_checked(ckpt, tmp_path):
    ds = data.load(write_jsonl(str(tmp_path / "c.jsonl"), [{"messages": c} for c in CHATS]), ckpt, seq=120)
    back = data.Dataset.from_bytes(ds.to_bytes())
    assert back.kind == "chat" and back.pad == ds.pad and back.digest() == ds.digest()
    assert all(torch.equal(getattr(back, k), getattr(ds, k)) for k in ("ids", "mask", "offsets"))
    with pytest.raises(DataError, match="does not read"):
        data.Dataset.from_bytes(b"nonsense")


def _fails(match, *args, **kw):
    with pytest.raises(DataError, match=match) as e:
        data.load(*args, **kw)
    assert isinstance(e.value, UsageError) and e.value.code == 2 and "\n" not in str(e.value)


def test_bad_input_is_one_line_naming_it(ckpt, tmp_path):
    chats = [{"messages": c} for c in CHATS[::-1]]  # the short one first
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_bytes((Path(ckpt) / "config.json").read_bytes())
    _fails("no tokenizer.json", write_jsonl(str(tmp_path / "a.jsonl"), chats), str(bare), seq=120)
    _fails("no such file", str(tmp_path / "missing.jsonl"), ckpt, seq=120)
    _fails(
        r"line 3: not a chat", write_jsonl(str(tmp_path / "b.jsonl"), [*chats, {"text": "x"}]), ckpt, seq=120
    )  # line 3
    _fails(r"line 2: not JSON", write_jsonl(str(tmp_path / "c.jsonl"), [chats[0], "{oops"]), ckpt, seq=120)
    bad_msg = {"messages": [{"content": "no role"}]}
    _fails(r"line 1: \"messages\" holds", write_jsonl(str(tmp_path / "d.jsonl"), [bad_msg]), ckpt, seq=120)
    no_asst = {"messages": [{"role": "user", "content": "hi"}]}
    _fails(r"line 1: no tokens to learn", write_jsonl(str(tmp_path / "e.jsonl"), [no_asst]), ckpt, seq=120)
    long = {"prompt": "Hello there " * 80, "completion": "fox"}
    _fails(
        r"line 2: \d+ tokens, longer than the model's context of 128",
        write_jsonl(str(tmp_path / "f.jsonl"), [chats[1], long]),
        ckpt,
        seq=120,
    )
    _fails(r"line 1: \d+ tokens, more than --seq 8", write_jsonl(str(tmp_path / "g.jsonl"), chats), ckpt, seq=8)
    _fails("exceeds the model's context", write_jsonl(str(tmp_path / "h.jsonl"), chats), ckpt, seq=512)
    none = make_finetune_checkpoint(str(tmp_path / "none"), template=None)
    _fails("line 1: .*no chat template", write_jsonl(str(tmp_path / "i.jsonl"), chats), none, seq=120)
    with pytest.raises(DataError, match="too few"):
        data.Batches(data.load(write_jsonl(str(tmp_path / "j.jsonl"), chats[:1]), ckpt, seq=120), 1, 64, 0, True)
    assert json.loads(json.dumps(str(DataError("x")))) == "x"


def test_messages_reach_the_template_as_transformers_hands_them(tmp_path):
    """None values dropped; reasoning under any of its names also as reasoning_content (Qwen3 reads it)."""
    import transformers

    thinking = MARKED.replace(
        "{{ message['content'] + '<|im_end|>\\n' }}",
        "{% if message.reasoning_content %}{{ 'think: ' + message.reasoning_content + '\\n' }}{% endif %}"
        "{{ message['content'] + '<|im_end|>\\n' }}{% if message.name is defined %}{{ 'none seen' }}{% endif %}",
    )
    assert thinking != MARKED
    path = make_finetune_checkpoint(str(tmp_path / "think"), template=thinking)
    chat = [
        {"role": "user", "content": "Hello there", "name": None},
        {"role": "assistant", "content": "fine", "reasoning": "the fox", "name": None},
    ]
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(path)
    ids, mask = _ours(path).chat_example(chat)
    assert (ids, mask) == _theirs(hf, chat)
    assert "think: the fox" in hf.decode(ids) and "none seen" not in hf.decode(ids)
