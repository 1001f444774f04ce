"""Does grpo.py learn, beside TRL's GRPOTrainer with the same algorithm? Held-out accuracy on the built-in task,
from a supervised warm start, on a CPU. Protocol and results: bench/README.md.

    pip install -r requirements.txt -r bench/requirements.txt
    python bench/learn_heldout.py              # warm start, then 5 contenders x 2 seeds (about 40 min on 2 cores)
    python bench/learn_heldout.py --seeds 0    # one seed each

Writes bench/out/heldout.md (the tables) and bench/out/heldout.png (held-out accuracy against step and against
training wall-clock, a line per run).

The pairs, like with like:
  grpo.py drgrpo                       vs  TRL loss_type="dr_grpo", scale_rewards="none", beta 0
  grpo.py dapo                         vs  TRL loss_type="dapo", epsilon_high 0.28, scale_rewards "group", the
                                           +1/-1 reward and TRL's soft overlong punishment (TRL has no dynamic
                                           sampling)
  grpo.py dapo --no-dynamic-sampling   (what dynamic sampling adds)
The task: the built-in arithmetic word problems; the held-out split holds out problems (operation and numbers),
not wordings, so held-out accuracy is new arithmetic. Both trainers read the same two files. The warm start: a
4-layer, 128-wide Qwen2 (tiny.py) with a 512-token BPE learnt from the training prompts, fine-tuned on worked
solutions (`23 + 45 = 68. The answer is \\boxed{68}.`) until held-out greedy accuracy reaches WARM_TARGET.
Every run: LoRA r16, the RL flags below, and held-out greedy accuracy every EVAL_EVERY steps by grpo.py's own
`evaluate` (TRL's from a callback, on the model it trains). Runs go two at a time, one thread each; each run is
seeded before its model is built, so a rerun repeats it.
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
WARM_TARGET, EVAL_PROMPTS, EVAL_EVERY = 0.25, 1024, 25
B, G, T, LR, WARMUP, STEPS = 16, 16, 32, 5e-4, 10, 100
RL = ["--prompts-per-step", str(B), "--num-generations", str(G), "--max-new-tokens", str(T), "--lora-r", "16",
      "--learning-rate", str(LR), "--warmup-steps", str(WARMUP), "--max-steps", str(STEPS), "--micro-batch-size",
      str(B * G), "--dtype", "fp32", "--eval-prompts", str(EVAL_PROMPTS), "--eval-every", str(EVAL_EVERY),
      "--save-every", "0"]
GRPO = {"grpo.py drgrpo": ["--algo", "drgrpo"], "grpo.py dapo": ["--algo", "dapo"],
        "grpo.py dapo, no dynamic sampling": ["--algo", "dapo", "--no-dynamic-sampling"]}
TRL = {"TRL dr_grpo": "dr_grpo", "TRL dapo": "dapo"}
PAIRS = [("grpo.py drgrpo", "TRL dr_grpo"), ("grpo.py dapo", "TRL dapo"),
         ("grpo.py dapo", "grpo.py dapo, no dynamic sampling")]
OPS = {"gets": "+", "gives away": "-", "boxes": "*", "shares": "/"}  # arithmetic_task's four kinds


def solution(ex: dict) -> str:
    """The worked solution of an arithmetic_task problem, e.g. '23 + 45 = 68. The answer is \\boxed{68}.'"""
    op = next(o for word, o in OPS.items() if word in ex["prompt"])
    x, y = re.findall(r"\d+", ex["prompt"])[:2]
    return f"{x} {op} {y} = {ex['answer']}. The answer is \\boxed{{{ex['answer']}}}."


def split_files():
    """The built-in task's training and held-out splits, as grpo.py makes them, to JSONL."""
    train, evals = grpo.load_data(grpo.parse_args(["--eval-prompts", str(EVAL_PROMPTS)]))
    paths = [os.path.join(OUT, f) for f in ("train.jsonl", "eval.jsonl")]
    for path, rows in zip(paths, (train, evals)):
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return train, evals, paths


def supervised_batch(tok, pairs):
    """(prompt text, completion text) pairs -> grpo.collate's batch, the loss on the completion (+ EOS) only."""
    rows = []
    for p, c in pairs:
        completion = torch.tensor(tok(c, add_special_tokens=False).input_ids + [tok.eos_token_id])
        rows.append(dict(record={"prompt": p, "answer": c}, prompt_ids=torch.tensor(tok(p, add_special_tokens=False)
                         .input_ids), completion=completion, truncated=False, order=0, is_teacher=False, reward=0.0,
                         rewards={}, logp=torch.zeros(len(completion)), tool_mask=torch.ones(len(completion))))
    return grpo.collate(rows, tok.pad_token_id, "cpu")


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
            log.append((step, round(grpo.evaluate(model, tok, evals[:256], a)["eval/accuracy"], 3)))
            print(f"  warm start: step {step}: loss {loss.item():.3f}, held-out greedy accuracy {log[-1][1]:.3f} "
                  f"(256 prompts)", flush=True)
            if log[-1][1] >= WARM_TARGET:
                break
    model.save_pretrained(model_dir)
    return log


def child(cmd, what):
    """One run in its own process, on one thread; if it fails, its own last lines say why. Its wall-clock."""
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if p.returncode:
        raise SystemExit(f"bench/learn_heldout.py: {what} failed:\n{p.stderr[-2000:]}")
    return time.time() - t0


def run_grpo(name, seed, model_dir, paths):
    """grpo.py's run: its held-out evaluations, each with the training wall-clock up to it (no evaluation)."""
    out = os.path.join(OUT, f"{name.replace(' ', '_').replace(',', '')}_seed{seed}")
    wall = child([sys.executable, os.path.join(ROOT, "grpo.py"), "--model", model_dir, "--dataset", paths[0],
                  "--eval-dataset", paths[1], "--output-dir", out, "--seed", str(seed), "--overwrite"] + RL
                 + GRPO[name], f"{name} (seed {seed})")
    rows, spent = [], 0.0
    for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))):
        spent += r.get("time/generate", 0) + r.get("time/reward", 0) + r.get("time/train", 0)
        if "eval/accuracy" in r:
            rows.append({"step": r["step"], "accuracy": r["eval/accuracy"], "seconds": spent})
    return {"rows": rows, "wall": wall}


def run_trl(name, seed, model_dir, paths):
    result = os.path.join(OUT, f"{name.replace(' ', '_')}_seed{seed}.json")
    wall = child([sys.executable, os.path.abspath(__file__), "--trl-child", TRL[name], str(seed), model_dir,
                  *paths, result], f"{name} (seed {seed})")
    return {"rows": json.load(open(result)), "wall": wall}


def trl_child(loss, seed, model_dir, train_path, eval_path, result):
    """TRL's GRPOTrainer with grpo.py's settings for the same algorithm (loss: "dr_grpo" or "dapo"); held-out
    accuracy by grpo.py's evaluate every EVAL_EVERY steps, on the model TRL trains."""
    import datasets
    from transformers import TrainerCallback, set_seed
    from trl import GRPOConfig, GRPOTrainer
    from trl.rewards import get_soft_overlong_punishment
    torch.set_num_threads(1)
    set_seed(seed)  # before the model and its LoRA are built: a rerun repeats
    a = grpo.parse_args(["--model", model_dir, "--seed", str(seed)] + RL)
    model, tok, _ = grpo.load_model(a, torch.device("cpu"))  # the same model and tokenizer, loaded the same way
    train, evals = (grpo.load_examples(p, "train", True) for p in (train_path, eval_path))
    rows = [{"prompt": [{"role": "system", "content": a.system_prompt}, {"role": "user", "content": ex["prompt"]}],
             "answer": ex["answer"]} for ex in train]
    score = R.correct if loss == "dr_grpo" else R.correct_pm1

    def correct(completions, answer, **kw):
        return [score(c[0]["content"], x) for c, x in zip(completions, answer)]
    log, clock = [], {"start": time.time(), "eval": 0.0}

    def evaluate(step):
        t0 = time.time()
        accuracy = grpo.evaluate(model, tok, evals, a)["eval/accuracy"]
        log.append({"step": step, "accuracy": accuracy, "seconds": t0 - clock["start"] - clock["eval"]})
        clock["eval"] += time.time() - t0

    class Evaluate(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step % EVAL_EVERY == 0 or state.global_step == STEPS:
                evaluate(state.global_step)
    evaluate(0)
    funcs = [correct] if loss == "dr_grpo" else [correct, get_soft_overlong_punishment(T, max(1, T // 5))]
    cfg = GRPOConfig(output_dir=os.path.join(OUT, f"trl_{loss}_seed{seed}"), per_device_train_batch_size=B * G,
                     num_generations=G, max_completion_length=T, learning_rate=LR, warmup_steps=WARMUP,
                     lr_scheduler_type="constant_with_warmup", beta=0.0, loss_type=loss, epsilon=0.2,
                     epsilon_high=0.28 if loss == "dapo" else 0.2, scale_rewards="none" if loss == "dr_grpo" else
                     "group", temperature=1.0, top_p=1.0, max_steps=STEPS, logging_steps=1, save_strategy="no",
                     report_to="none", use_cpu=True, seed=seed, bf16=False, disable_dropout=True,
                     gradient_checkpointing=False, max_grad_norm=1.0, weight_decay=0.0)
    trainer = GRPOTrainer(model=model, reward_funcs=funcs, args=cfg, processing_class=tok, callbacks=[Evaluate()],
                          train_dataset=datasets.Dataset.from_list(rows))
    trainer.train()
    json.dump(log, open(result, "w"))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--trl-child", nargs=6, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_child:
        return trl_child(args.trl_child[0], int(args.trl_child[1]), *args.trl_child[2:])
    os.makedirs(OUT, exist_ok=True)
    t0 = time.time()
    train, evals, paths = split_files()
    model_dir = os.path.join(OUT, "warm")
    warm = warm_start(model_dir, train, evals)
    print(f"warm start: {time.time() - t0:.0f} s, held-out greedy accuracy {warm[-1][1]:.3f}", flush=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    jobs = [(name, s) for s in seeds for name in (*GRPO, *TRL)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two cores: two runs at a time, a thread each
        futures = {job: pool.submit(run_trl if job[0] in TRL else run_grpo, *job, model_dir, paths) for job in jobs}
        results = {job: f.result() for job, f in futures.items()}
    report(results, warm, time.time() - t0, seeds)


def report(results, warm, wall, seeds):
    n = EVAL_PROMPTS
    table = ["| run | seed | held-out greedy: start | end | rise (points) | run's wall-clock (min) |",
             "| --- | --- | --- | --- | --- | --- |"]
    ends = {}
    for (name, seed), res in results.items():
        first, last = res["rows"][0]["accuracy"], res["rows"][-1]["accuracy"]
        ends.setdefault(name, []).append(last)
        table.append(f"| {name} | {seed} | {first:.3f} | {last:.3f} | {100 * (last - first):+.1f} | "
                     f"{res['wall'] / 60:.1f} |")
    start = next(iter(results.values()))["rows"][0]["accuracy"]

    def se(xs):  # the mean's standard error: over seeds, and never below one evaluation's binomial error
        binomial = statistics.mean(x * (1 - x) for x in xs) / n / len(xs)
        spread = statistics.variance(xs) / len(xs) if len(xs) > 1 else 0.0
        return math.sqrt(max(binomial, spread))
    pairs = ["| pair | end accuracy: A | B | A - B (points) | standard error (points) |", "| --- | --- | --- | --- | --- |"]
    for a, b in PAIRS:
        diff, err = statistics.mean(ends[a]) - statistics.mean(ends[b]), math.hypot(se(ends[a]), se(ends[b]))
        pairs.append(f"| {a} vs {b} | {statistics.mean(ends[a]):.3f} | {statistics.mean(ends[b]):.3f} | "
                     f"{100 * diff:+.1f} | {100 * err:.1f} |")
    md = "\n".join(table + [""] + pairs + ["", f"start (the warm start): {start:.3f} on {n} held-out problems; warm "
                                                f"start reached {warm[-1][1]:.3f} (256 prompts) after {warm[-1][0]} "
                                                f"steps; seeds {seeds}; whole run {wall / 60:.1f} min"])
    print(md, flush=True)
    with open(os.path.join(OUT, "heldout.md"), "w") as f:
        f.write(md + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    colors = dict(zip(ends, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for (name, seed), res in results.items():
        for ax, key in zip(axes, ("step", "seconds")):
            ax.plot([r[key] / (60 if key == "seconds" else 1) for r in res["rows"]],
                    [r["accuracy"] for r in res["rows"]], color=colors[name], ls="-" if seed == seeds[0] else "--",
                    label=f"{name}, seed {seed}" if ax is axes[0] else None)
    axes[0].set(xlabel="step", ylabel=f"held-out greedy accuracy ({n} problems)")
    axes[1].set(xlabel="training wall-clock (min, 1 thread, evaluation excluded)")
    axes[0].legend(fontsize=7)
    fig.suptitle("tiny Qwen2 from a warm start on the built-in task: grpo.py beside TRL, like with like")
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "heldout.png"), dpi=110)


if __name__ == "__main__":
    main()
