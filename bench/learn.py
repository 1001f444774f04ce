"""Does grpo.py learn? Each preset on a tiny local model and a verifiable toy task, on a CPU.

    python bench/learn.py [STEPS]    # all presets and the mixed pool, 800 steps each (STEPS); bench/out/learning.md

The task: 'a+b=' for digits a, b (100 prompts), reward `correct` (1/0; DAPO's preset uses +1/-1).
The model: a 2-layer Qwen2 built locally (tiny.py), byte-level tokenizer, given a short supervised
warm-up (200 batches of 16 sums drawn from the table) so it starts with the answer format and
partial accuracy (about 0.35 sampled); the warm-up is reported beside the results. Then grpo.py
trains it from there: full fine-tuning, 32 prompts x 8 completions a step, lr 2e-3, 800 steps.
"""
import json
import os
import random
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import grpo  # noqa: E402
import tiny  # noqa: E402

OUT = os.path.join(ROOT, "bench", "out")


def task(n_digits=10):
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(n_digits) for b in range(n_digits)]


def warmup(model_dir, data, steps, seed=0, hidden=64, layers=2):
    """Supervised warm-up on `steps` batches of 16 sums drawn from the task: the model learns
    the format (digits, then EOS) and some of the table. Returns its greedy accuracy on the task."""
    tiny.make_tiny(model_dir, layers=layers, hidden=hidden, seed=seed)
    a = grpo.parse_args(["--model", model_dir, "--lora-r", "0", "--system-prompt", "", "--max-new-tokens", "4"])
    model, tok, _ = grpo.load_model(a, torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(seed)
    seen = data
    for _ in range(steps):
        batch = [rng.choice(seen) for _ in range(16)]
        prompts = [tok(grpo.chat_prompt(tok, ex["prompt"], ""), add_special_tokens=False).input_ids for ex in batch]
        answers = [tok(ex["answer"], add_special_tokens=False).input_ids + [tok.eos_token_id] for ex in batch]
        rows = [dict(record=ex, prompt_ids=torch.tensor(p), completion=torch.tensor(c), truncated=False, order=0,
                     is_teacher=False, reward=0.0, rewards={}, logp=torch.zeros(len(c)), tool_mask=torch.ones(len(c)))
                for ex, p, c in zip(batch, prompts, answers)]
        b = grpo.collate(rows, tok.pad_token_id, "cpu")
        logp, _ = grpo.token_logps(model, b["input_ids"], b["attention_mask"], b["mask"].shape[1])
        loss = -(logp * b["mask"]).sum() / b["mask"].sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(model_dir)
    acc = grpo.evaluate(model, tok, data, a, 0, 1)["eval/accuracy"]
    return acc


def run(out, model_dir, data_path, steps, extra, seed=0):
    """grpo.py in a subprocess with the demo's flags; returns its metrics rows and wall time."""
    t0 = time.time()
    cmd = [sys.executable, os.path.join(ROOT, "grpo.py"), "--model", model_dir, "--dataset", data_path,
           "--eval-dataset", data_path, "--eval-prompts", "100", "--eval-every", str(steps), "--output-dir", out,
           "--max-steps", str(steps), "--system-prompt", "", "--max-new-tokens", "4", "--prompts-per-step", "32",
           "--num-generations", "8", "--micro-batch-size", "256", "--lora-r", "0", "--learning-rate", "2e-3",
           "--save-every", "0", "--seed", str(seed), "--overwrite"] + extra
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:  # grpo.py's own last lines say why
        raise SystemExit(f"bench/learn.py: grpo.py failed ({' '.join(extra)}):\n{p.stderr[-2000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return [r for r in rows if r["step"] > 0], time.time() - t0  # step 0: the evaluation before training


CONTENDERS = {  # name -> grpo.py flags
    "grpo": ["--algo", "grpo"],
    "drgrpo": ["--algo", "drgrpo"],
    "dapo": ["--algo", "dapo"],
    "drgrpo_soft": ["--algo", "drgrpo_soft"],
    "mixed (drgrpo, G_s 7 + G_t 1)": ["--algo", "drgrpo", "--num-generations", "7", "--teacher-per-group", "1"],
}


def write_pool(path, data):
    """A teacher pool as a stronger model would leave it: per prompt two right answers and one off by one,
    rewards graded once and frozen."""
    with open(path, "w") as f:
        for d in data:
            for text, r in ((d["answer"], 1.0), (d["answer"], 1.0), (str(int(d["answer"]) + 1), 0.0)):
                f.write(json.dumps({"prompt": d["prompt"], "completion": text, "reward": r}) + "\n")


def smooth(xs, k=10):
    return [sum(xs[max(0, i - k + 1):i + 1]) / len(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]


def main(steps=800, warmup_steps=200):
    os.makedirs(OUT, exist_ok=True)
    data = task()
    data_path, pool_path, model_dir = (os.path.join(OUT, f) for f in ("task.jsonl", "pool.jsonl", "warm"))
    with open(data_path, "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in data)
    write_pool(pool_path, data)
    t0 = time.time()
    acc = warmup(model_dir, data, warmup_steps)
    print(f"warm-up: {warmup_steps} steps x 16 sums, {time.time() - t0:.0f}s, greedy accuracy {acc:.2f}")
    table = ["| run | reward at start | reward at end | accuracy at start | accuracy at end | greedy eval | steps | wall time |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    curves = {}
    for name, flags in CONTENDERS.items():
        extra = flags + (["--teacher-pool", pool_path] if "--teacher-per-group" in flags else [])
        rows, wall = run(os.path.join(OUT, name.split(" ")[0]), model_dir, data_path, steps, extra)
        rew, acc = [r["reward/mean"] for r in rows], [r["accuracy"] for r in rows]
        key = "reward/mean_student" if "reward/mean_student" in rows[0] else "reward/mean"
        rew = [r[key] for r in rows]  # the mixed run: the student's own samples, not the pool's
        first, last = (lambda xs: statistics.mean(xs[:20])), (lambda xs: statistics.mean(xs[-20:]))
        table.append(f"| {name} | {first(rew):.2f} | {last(rew):.2f} | {first(acc):.2f} | {last(acc):.2f} "
                     f"| {rows[-1]['eval/accuracy']:.2f} | {len(rows)} | {wall:.0f} s |")
        curves[name] = smooth(acc)
        print(table[-1], flush=True)
    md = "\n".join(table)
    with open(os.path.join(OUT, "learning.md"), "w") as f:
        f.write(md + "\n")
    try:
        import matplotlib
    except ImportError:  # (bench/requirements.txt)
        return print(f"no plot without matplotlib: the table is in {OUT}/learning.md")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, label=name)
    ax.axhline(0.8, color="gray", lw=0.8, ls="--")
    ax.set(xlabel="step", ylabel="sampled accuracy (10-step mean)", ylim=(0, 1),
           title=f"tiny Qwen2 on a+b=, after a {warmup_steps}-step supervised warm-up")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "learning.png"), dpi=110)


if __name__ == "__main__":
    main(*map(int, sys.argv[1:2]))
