"""Does grpo.py learn, the way papers show it? Held-out accuracy on the built-in task, from a supervised warm
start, beside TRL's GRPOTrainer with the same settings. On a CPU.

    pip install -r requirements.txt -r bench/requirements.txt
    python bench/learn_heldout.py          # warm start; drgrpo, dapo and TRL (Dr. GRPO loss), 2 seeds each
    python bench/learn_heldout.py --all    # + grpo, drgrpo_soft and the mixed pool (G_s 14 + G_t 2)

Writes bench/out/heldout.md (the table) and bench/out/heldout.png (held-out accuracy against step, a line per run).

The task: grpo.py's built-in arithmetic word problems (`arithmetic_task`): its training split and its own
held-out split, disjoint (load_data leaves the held-out prompts out of training), written once to bench/out/ so
that every run, of either trainer, reads the same files.
The warm start (`warm_start`): a 4-layer, 128-wide Qwen2 built by tiny.py, with a 512-token BPE learnt from the
training prompts by Qwen2's pre-tokenizer (words whole, numbers a digit a token): a prompt is ~60 tokens. With
one token a byte it was ~250, and the same fine-tune reached 2% in 7 minutes. Fine-tuned on worked solutions of training
problems written the way the `correct` reward reads them (`23 + 45 = 68. The answer is \\boxed{68}.`), through
the chat template with the default system prompt, loss on the completion only, 64 a step at lr 2e-3, stopped
once held-out greedy accuracy reaches WARM_TARGET (checked every 50 steps). Saved as an ordinary model
directory that `grpo.py --model DIR` takes.
Each run, from it: LoRA r16, the RL flags below, held-out greedy accuracy (and mean@k, pass@k) every EVAL_EVERY
steps through grpo.py's own `evaluate`. TRL: GRPOTrainer with loss dr_grpo, no std scaling, beta 0, and the same
model and LoRA, data, reward (`rewards.correct`), learning rate and warm-up (HF's schedule is one step behind:
lr 0 at its first step), group size, max new tokens, batch and steps, evaluated by the same `evaluate` on the
same prompts (a callback). Runs go two at a time, one thread each.
The figures, what they mean and what was tried on the way: README, "It learns".
"""
import argparse
import concurrent.futures
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import grpo  # noqa: E402
import rewards as R  # noqa: E402
import tiny  # noqa: E402

OUT = os.path.join(ROOT, "bench", "out")
MODEL, VOCAB = dict(layers=4, hidden=128, heads=4, kv_heads=2), 512
WARM_TARGET, EVAL_PROMPTS, EVAL_EVERY, EVAL_SAMPLES = 0.25, 256, 20, 4
B, G, T, LR, WARMUP, STEPS = 16, 16, 32, 5e-4, 10, 120
RL = ["--prompts-per-step", str(B), "--num-generations", str(G), "--max-new-tokens", str(T), "--lora-r", "16",
      "--learning-rate", str(LR), "--warmup-steps", str(WARMUP), "--max-steps", str(STEPS), "--micro-batch-size",
      str(B * G), "--dtype", "fp32",
      "--eval-prompts", str(EVAL_PROMPTS), "--eval-every", str(EVAL_EVERY), "--eval-samples", str(EVAL_SAMPLES),
      "--save-every", "0", "--overwrite"]
OPS = {"gets": "+", "gives away": "-", "boxes": "*", "shares": "/"}  # arithmetic_task's four kinds


def solution(ex: dict) -> str:
    """The worked solution of an arithmetic_task problem, e.g. '23 + 45 = 68. The answer is \\boxed{68}.'"""
    op = next(o for word, o in OPS.items() if word in ex["prompt"])
    x, y = re.findall(r"\d+", ex["prompt"])[:2]
    return f"{x} {op} {y} = {ex['answer']}. The answer is \\boxed{{{ex['answer']}}}."


def split_files():
    """The built-in task's training and held-out splits, as grpo.py makes them, to JSONL."""
    train, evals = grpo.load_data(grpo.parse_args(["--eval-prompts", str(EVAL_PROMPTS)]))
    assert not {e["prompt"] for e in evals} & {t["prompt"] for t in train}
    paths = [os.path.join(OUT, f) for f in ("train.jsonl", "eval.jsonl")]
    for path, rows in zip(paths, (train, evals)):
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return train, evals, paths


def supervised_batch(tok, pairs):
    """(prompt text, completion text) pairs -> grpo.collate's batch, the loss on the completion (+ EOS) only."""
    groups = [dict(prompt_ids=torch.tensor(tok(p, add_special_tokens=False).input_ids), completions=[torch.tensor(
        tok(c, add_special_tokens=False).input_ids + [tok.eos_token_id])], truncated=[False], adv=[0.0],
        is_teacher=[False], rewards=torch.zeros(1), sampler_logp=[torch.zeros(1)]) for p, c in pairs]
    return grpo.collate(groups, tok.pad_token_id, "cpu")


def warm_start(model_dir, train, evals, seed=0, max_steps=3000, check_every=50):
    """The supervised warm start (see the module docstring); returns its log: [(step, held-out accuracy)]."""
    a = grpo.parse_args(["--max-new-tokens", str(T)])
    corpus = ["system user assistant", a.system_prompt] + [ex["prompt"] + "\n" + solution(ex) for ex in train]
    torch.manual_seed(seed)
    tiny.make_tiny(model_dir, seed=seed, vocab=VOCAB, corpus=corpus, **MODEL)
    a = grpo.parse_args(["--model", model_dir, "--lora-r", "0", "--dtype", "fp32", "--max-new-tokens", str(T)])
    model, tok, _ = grpo.load_model(a, torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 200))
    rng, log = random.Random(seed), []
    for step in range(1, max_steps + 1):
        b = supervised_batch(tok, [(grpo.chat_prompt(tok, ex["prompt"], a.system_prompt), solution(ex))
                                   for ex in (rng.choice(train) for _ in range(64))])
        logp, _ = grpo.token_logps(model, b["input_ids"], b["attention_mask"], b["mask"].shape[1])
        loss = -(logp * b["mask"]).sum() / b["mask"].sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        warmup.step()
        if step % check_every == 0:
            log.append((step, round(grpo.evaluate(model, tok, evals, a, 0, 1)["eval/accuracy"], 3)))
            print(f"  warm start: step {step}: loss {loss.item():.3f}, held-out greedy accuracy {log[-1][1]:.3f}",
                  flush=True)
            if log[-1][1] >= WARM_TARGET:
                break
    model.save_pretrained(model_dir)
    return log


def child(cmd, what):
    """One run in its own process, on one thread; if it fails, its own last lines say why."""
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if p.returncode:
        raise SystemExit(f"bench/learn_heldout.py: {what} failed:\n{p.stderr[-2000:]}")


def run_grpo(name, flags, seed, model_dir, paths):
    out = os.path.join(OUT, f"{name}_seed{seed}")
    cmd = [sys.executable, os.path.join(ROOT, "grpo.py"), "--model", model_dir, "--dataset", paths[0],
           "--eval-dataset", paths[1], "--output-dir", out, "--seed", str(seed)] + RL + flags
    child(cmd, f"grpo.py ({name}, seed {seed})")
    return [r for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if "eval/accuracy" in r]


def run_trl(seed, model_dir, paths):
    result = os.path.join(OUT, f"trl_seed{seed}.json")
    child([sys.executable, os.path.abspath(__file__), "--trl-child", str(seed), model_dir, *paths, result],
          f"TRL (seed {seed})")
    return json.load(open(result))


def trl_child(seed, model_dir, train_path, eval_path, result):
    """TRL's GRPOTrainer with grpo.py's drgrpo settings; held-out accuracy by grpo.py's evaluate, every EVAL_EVERY
    steps, on the model TRL trains."""
    import datasets
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    torch.set_num_threads(1)
    a = grpo.parse_args(["--model", model_dir, "--seed", str(seed)] + RL[:-1])
    model, tok, _ = grpo.load_model(a, torch.device("cpu"))  # the same model and tokenizer, loaded the same way
    train, evals = (grpo.load_examples(p, True) for p in (train_path, eval_path))
    rows = [{"prompt": [{"role": "system", "content": a.system_prompt}, {"role": "user", "content": ex["prompt"]}],
             "answer": ex["answer"]} for ex in train]

    def correct(completions, answer, **kw):
        return [R.correct(c[0]["content"], x) for c, x in zip(completions, answer)]
    log = [{"step": 0, **grpo.evaluate(model, tok, evals, a, 0, 1)}]

    class Evaluate(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step % EVAL_EVERY == 0 or state.global_step == STEPS:
                log.append({"step": state.global_step, **grpo.evaluate(model, tok, evals, a, 0, 1)})
    cfg = GRPOConfig(output_dir=os.path.join(OUT, f"trl_seed{seed}"), per_device_train_batch_size=B * G, bf16=False,
                     num_generations=G, max_completion_length=T, learning_rate=LR, warmup_steps=WARMUP,
                     lr_scheduler_type="constant_with_warmup",
                     beta=0.0, loss_type="dr_grpo", scale_rewards="none", epsilon=0.2, temperature=1.0, top_p=1.0,
                     max_steps=STEPS, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=seed,
                     disable_dropout=True, gradient_checkpointing=False, max_grad_norm=1.0, weight_decay=0.0)
    trainer = GRPOTrainer(model=model, reward_funcs=correct, args=cfg, processing_class=tok, callbacks=[Evaluate()],
                          train_dataset=datasets.Dataset.from_list(rows))
    trainer.train()
    json.dump(log, open(result, "w"))


CONTENDERS = {"drgrpo": ["--algo", "drgrpo"], "dapo": ["--algo", "dapo"]}
MORE = {"grpo": ["--algo", "grpo"], "drgrpo_soft": ["--algo", "drgrpo_soft"],
        "mixed (drgrpo, G_s 14 + G_t 2)": ["--algo", "drgrpo", "--num-generations", "14", "--teacher-per-group", "2"]}


def write_pool(path, train):
    """A teacher pool as a stronger model would leave it: per prompt a worked solution (reward 1) and one with the
    answer off by one (reward 0), graded once and frozen."""
    with open(path, "w") as f:
        for ex in train:
            right = solution(ex)
            wrong = right.replace(ex["answer"], str(int(ex["answer"]) + 1))
            f.writelines(json.dumps({"prompt": ex["prompt"], "completion": c, "reward": r}) + "\n"
                         for c, r in ((right, 1.0), (wrong, 0.0)))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--all", action="store_true", help="the other presets and the mixed pool too")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--trl-child", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_child:
        return trl_child(int(args.trl_child[0]), *args.trl_child[1:])
    os.makedirs(OUT, exist_ok=True)
    t0 = time.time()
    train, evals, paths = split_files()
    model_dir = os.path.join(OUT, "warm")
    warm = warm_start(model_dir, train, evals)
    print(f"warm start: {time.time() - t0:.0f} s, held-out greedy accuracy {warm[-1][1]:.3f}", flush=True)
    contenders = {**CONTENDERS, **(MORE if args.all else {})}
    if args.all:
        write_pool(os.path.join(OUT, "pool.jsonl"), train)
        contenders["mixed (drgrpo, G_s 14 + G_t 2)"] += ["--teacher-pool", os.path.join(OUT, "pool.jsonl")]
    seeds = [int(s) for s in args.seeds.split(",")]
    jobs = [(name, s) for name in [*contenders, "TRL (dr_grpo)"] for s in seeds]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two cores: two runs at a time, a thread each
        futures = {job: pool.submit(run_trl, job[1], model_dir, paths) if job[0].startswith("TRL") else
                   pool.submit(run_grpo, job[0].split(" ")[0], contenders[job[0]], job[1], model_dir, paths)
                   for job in jobs}
        results = {job: f.result() for job, f in futures.items()}
    report(results, warm, time.time() - t0, args)


def report(results, warm, wall, args):
    k = EVAL_SAMPLES
    table = [f"| run | seed | held-out greedy: start | end | rise (points) | mean@{k}: start | end | pass@{k}: start "
             f"| end |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    rises = {}
    for (name, seed), rows in results.items():
        first, last = rows[0], rows[-1]
        rise = 100 * (last["eval/accuracy"] - first["eval/accuracy"])
        rises.setdefault(name, []).append(rise)
        table.append(f"| {name} | {seed} | {first['eval/accuracy']:.3f} | {last['eval/accuracy']:.3f} | {rise:+.1f} | "
                     + " | ".join(f"{row.get(f'eval/{m}@{k}', math.nan):.3f}" for m in ("mean", "pass")
                                  for row in (first, last)) + " |")
    p0 = results[next(iter(results))][0]["eval/accuracy"]
    noise = 100 * math.sqrt(p0 * (1 - p0) / EVAL_PROMPTS)  # one evaluation's binomial standard error, in points
    mean = {name: statistics.mean(r) for name, r in rises.items()}
    summary = [f"- {name}: rise {mean[name]:+.1f} points (seeds: {', '.join(f'{x:+.1f}' for x in r)}); target +15: "
               f"{'met' if min(r) >= 15 else 'not met'}" for name, r in rises.items()]
    summary.append(f"- one evaluation's standard error: {noise:.1f} points ({EVAL_PROMPTS} prompts at {p0:.2f})")
    trl = mean["TRL (dr_grpo)"]
    summary.append(f"- grpo.py drgrpo's rise / TRL's: {mean['drgrpo'] / trl:.2f}x (target >= 0.9x)" if trl > 2 * noise
                   else f"- TRL's rise ({trl:+.1f}) is within two standard errors of 0: no ratio")
    md = "\n".join(table + [""] + summary + ["", f"warm start: held-out greedy accuracy {warm[-1][1]:.3f} after "
                                                f"{warm[-1][0]} steps; whole run {wall / 60:.1f} min"])
    print(md, flush=True)
    with open(os.path.join(OUT, "heldout.md"), "w") as f:
        f.write(md + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    colors = dict(zip(rises, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for (name, seed), rows in results.items():
        ax.plot([r["step"] for r in rows], [r["eval/accuracy"] for r in rows], color=colors[name],
                ls="-" if seed == 0 else "--", label=f"{name} seed {seed}")
    ax.set(xlabel="step", ylabel="held-out greedy accuracy", ylim=(0, 0.6),
           title=f"tiny Qwen2 on the built-in task ({EVAL_PROMPTS} held-out prompts), from a warm start")
    ax.legend(loc="upper left", fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "heldout.png"), dpi=110)


if __name__ == "__main__":
    main()
