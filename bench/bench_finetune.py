"""Fine-tuning on one host: `smoltrain run --strategy dp --local 1 --model HF_DIR` tokens/s against
a plain transformers loop (AutoModelForCausalLM + torch.optim.AdamW) and TRL's SFTTrainer when
`trl` imports; with --lora, our LoRA against PEFT's on the same loop.

Every system trains the same random-weight Llama checkpoint (bench/llama_checkpoint.py, hidden
512, 8 layers, vocabulary 8000: 31M parameters; a byte-level BPE tokenizer.json trained here) in
fp32 on the same token windows: the baselines take the batches our run trains on
(finetune.data.Batches from the same --data, seed and shape) and the same loss (mean cross
entropy over the targets), learning rate and threads (torch.set_num_threads; our --threads).
Rounds alternate the systems so a slow spell of a shared machine hits each; a figure is the
median step after `--warmup` steps, then the median over rounds.

    .venv/bin/python bench/bench_finetune.py --rounds 3 --steps 12 --warmup 2 --lora

(TRL: `pip install --target DIR trl datasets` and PYTHONPATH=DIR; it is no dependency of ours.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from common import ROOT, exit_code, write_result

BAR = "ours tokens/s >= a plain transformers + AdamW loop's (31M Llama, fp32, same threads and windows)"
SHAPE = {"hidden": 512, "layers": 8, "vocab": 8000}
SEED, LR = 0, 1e-4


def checkpoint(folder: str) -> str:
    """The bench's Llama with a tokenizer.json (what `run --data` tokenizes with), built once."""
    from llama_checkpoint import build

    if os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return folder
    build(folder, SHAPE["hidden"], SHAPE["layers"], SHAPE["vocab"], tokenizer=False)
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tm

    from smoltrain.models.data import load_corpus

    tok = Tokenizer(tm.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = load_corpus(None, 1 << 20).decode("utf-8", "replace").splitlines()
    trainer = trainers.BpeTrainer(
        vocab_size=SHAPE["vocab"] - 8, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(text, trainer)
    tok.save(os.path.join(folder, "tokenizer.json"))
    return folder


def ours(model: str, data: str, a, lora: bool, out: str) -> dict:
    argv = [sys.executable, "-m", "smoltrain", "run", "--strategy", "dp", "--local", "1", "--model", model]
    argv += ["--data", data, "--steps", str(a.steps), "--batch", str(a.batch), "--seq", str(a.seq)]
    argv += ["--lr", str(LR), "--seed", str(SEED), "--threads", str(a.threads), "--json", out]
    argv += ["--out", os.path.dirname(out), *(["--lora-rank", str(a.rank)] if lora else [])]
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"our run failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    with open(out) as f:
        doc = json.load(f)
    steps = doc["steps"][a.warmup :]
    return {"tokens_per_s": statistics.median(s["tokens"] / s["step_s"] for s in steps), "loss": steps[-1]["loss"]}


def windows(model: str, data: str, a) -> list:
    """The (x, y) batches our run trains on, step by step (y: -100 where no loss)."""
    from smoltrain.finetune.data import Batches, load

    b = Batches(load(data, model, a.seq), a.batch, a.seq, SEED)
    return [b.global_batch(s) for s in range(a.steps)]


def hf_model(model: str, lora: bool, rank: int):
    import torch
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    m.train()
    if lora:
        import peft

        m = peft.get_peft_model(m, peft.LoraConfig(r=rank, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    return m


def transformers_loop(model: str, batches: list, a, lora: bool) -> dict:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(a.threads)
    torch.manual_seed(SEED)
    m = hf_model(model, lora, a.rank)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR)
    rates, loss = [], None
    for i, (x, y) in enumerate(batches):
        t = time.perf_counter()
        logits = m(input_ids=x).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=-100)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= a.warmup:
            rates.append(x.numel() / (time.perf_counter() - t))
    return {"tokens_per_s": statistics.median(rates), "loss": float(loss.detach())}


def trl_loop(model: str, batches: list, a, lora: bool, out: str) -> dict:
    """SFTTrainer on the same windows (input_ids = x plus its last target: the model shifts them;
    given as token ids, so TRL's `datasets` preparation is skipped), one process; tokens/s from the time between step begin and end callbacks."""
    import datasets
    import pyarrow
    import torch
    import transformers
    import trl
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    torch.set_num_threads(a.threads)
    rows = [[*xr.tolist(), int(yr[-1])] for x, y in batches for xr, yr in zip(x, y, strict=True)]
    marks: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *args, **kw):
            marks.append(time.perf_counter())

        def on_step_end(self, *args, **kw):
            marks.append(time.perf_counter())

    cfg = trl.SFTConfig(
        output_dir=out,
        per_device_train_batch_size=a.batch,
        max_steps=a.steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.01,
        max_length=a.seq + 1,
        packing=False,
        logging_steps=a.steps,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        gradient_checkpointing=False,  # like the other loops (TRL turns it on by default)
        bf16=False,  # fp32 like the others (TRL autocasts to bf16 by default)
        dataset_num_proc=None,
        seed=SEED,
        dataset_kwargs={"skip_prepare_dataset": True},  # the windows are token ids already
    )
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(model, "tokenizer.json"), eos_token="</s>", pad_token="</s>"
    )
    trainer = trl.SFTTrainer(
        model=hf_model(model, lora, a.rank),
        args=cfg,
        # built from an Arrow table with a fingerprint given: datasets' own hashing fails under this pyarrow
        train_dataset=datasets.Dataset(pyarrow.table({"input_ids": rows}), fingerprint="bench-finetune"),
        processing_class=tok,
        data_collator=DataCollatorForLanguageModeling(pad_token_id=tok.pad_token_id),
        callbacks=[Clock()],
    )
    trainer.train()
    steps = list(zip(marks[::2], marks[1::2], strict=True))[a.warmup :]
    return {"tokens_per_s": statistics.median(a.batch * a.seq / (e - b) for b, e in steps)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lora", action="store_true", help="also LoRA (rank --rank on q_proj, v_proj): ours vs PEFT")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--model", default=os.path.join(tempfile.gettempdir(), "bench-finetune-llama31m"))
    a = p.parse_args()
    if not 0 <= a.warmup < a.steps:
        p.error("--warmup must be below --steps")
    tmp = tempfile.mkdtemp(prefix="bench-finetune-")
    model = checkpoint(a.model)
    data = os.path.join(tmp, "text.txt")
    from smoltrain.models.data import load_corpus

    with open(data, "wb") as f:
        f.write(load_corpus(None, 1 << 20))
    batches = windows(model, data, a)
    try:
        import trl  # noqa: F401

        have_trl = True
    except ImportError:
        have_trl = False
    modes = ["full", "lora"] if a.lora else ["full"]
    runs: dict[str, list[dict]] = {}
    for r in range(a.rounds):
        for mode in modes:
            lora = mode == "lora"
            runs.setdefault(f"ours_{mode}", []).append(
                ours(model, data, a, lora, os.path.join(tmp, f"o{r}{mode}.json"))
            )
            runs.setdefault(f"transformers_{mode}", []).append(transformers_loop(model, batches, a, lora))
            if have_trl:
                runs.setdefault(f"trl_{mode}", []).append(trl_loop(model, batches, a, lora, os.path.join(tmp, "trl")))
            print(r, mode, {k: round(v[-1]["tokens_per_s"], 1) for k, v in runs.items() if k.endswith(mode)})
    rate = {k: statistics.median(x["tokens_per_s"] for x in v) for k, v in runs.items()}
    ratio = {m: rate[f"ours_{m}"] / rate[f"transformers_{m}"] for m in modes}
    met = ratio["full"] >= 1.0
    head = f"ours/transformers tokens/s: full {ratio['full']:.2f}x ({rate['ours_full']:.0f} vs {rate['transformers_full']:.0f})"
    if a.lora:
        head += f", LoRA {ratio['lora']:.2f}x vs PEFT ({rate['ours_lora']:.0f} vs {rate['transformers_lora']:.0f})"
    head += "; TRL SFTTrainer " + (
        ", ".join(f"{m} {rate[f'trl_{m}']:.0f}" for m in modes) if have_trl else "left out (trl does not import)"
    )
    print(head)
    data_doc = {
        "model": {**SHAPE, "params": _params(model)},
        "batch": a.batch,
        "seq": a.seq,
        "threads": a.threads,
        "dtype": "fp32",
        "steps": a.steps,
        "warmup": a.warmup,
        "rounds": a.rounds,
        "tokens_per_s": rate,
        "ratio_ours_over_transformers": ratio,
        "trl": have_trl,
        "runs": runs,
    }
    write_result("bench_finetune", BAR, met, head, data_doc)
    return exit_code(met)


def _params(folder: str) -> int:
    from llama_checkpoint import params

    return params(folder)


if __name__ == "__main__":
    sys.exit(main())
