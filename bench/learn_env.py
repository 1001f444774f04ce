"""Does RL with an environment learn to read its replies? Held-out success at finding a hidden number from 1 to
100 in at most 7 guesses (bench/guess_env.py), from a supervised warm start, with the replies ("higher",
"lower", "right": --env bench/guess_env.py:Guess) and with them hidden (every reply "no answer": :Blind), on a
CPU. Protocol: bench/README.md.

    python bench/learn_env.py               # warm start, then 2 runs x 3 seeds, two at a time
    python bench/learn_env.py --seeds 0     # one seed each
    python bench/learn_env.py --smoke       # a few steps of each part (a minute): it runs

Writes bench/out/env.md (the tables).

The game's number is drawn from the record's seed; one seed in four is held out by a hash, so no evaluation game
is a training game. The warm start: a tiny Qwen2 (tiny.py, its tools chat template, a BPE learnt from the
transcripts) fine-tuned on transcripts as the chat template renders them with the game's schema in the prompt:
READ_SHARE of them play binary search on the replies, the rest guess at random; loss on the model's turns only
(the replies are conditioning, as in the RL runs), at a constant learning rate, on two threads. Then grpo.py
from it, the same flags with :Guess and with :Blind, rewarded 1 for a win (guess_env.won). Success, the
measure: grpo.py's held-out sampled eval/mean@k (EVAL_SAMPLES games a held-out number, at the temperature the
run samples: the policy RL trains), before the first step and after the last; beside it grpo.py's greedy
eval/accuracy (the last number the model writes is its last guess, the hidden number when it won). Runs go
two at a time, one thread each; each is seeded, so a rerun repeats it. The warm start is kept (warm_start).
The wall-clock of the warm start and of each run is printed as it ends.
"""
import argparse
import concurrent.futures
import json
import math
import os
import random
import statistics
import sys
import time
import zlib

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path[:0] = [ROOT, BENCH]
import grpo  # noqa: E402
import learn_tools as lt  # noqa: E402  (its supervised loss, prefix cache and child runs)
import tiny  # noqa: E402

OUT = os.path.join(BENCH, "out")
GAME = os.path.join(BENCH, "guess_env.py")
MODEL, VOCAB = dict(layers=4, hidden=128, heads=4, kv_heads=2), 1024
N_TRAIN, EVAL_PROMPTS, EVAL_SAMPLES, READ_SHARE, LIMIT = 20000, 64, 2, 0.8, 7
WARM_STEPS, WARM_BATCH, WARM_LR = 600, 32, 2e-3
B, G, T, LR, WARMUP, STEPS = 8, 8, 300, 3e-4, 3, 15  # (T: 7 guesses and their replies)
PROMPT = "Find the hidden whole number from 1 to 100 in at most 7 guesses."
RUNS = {"replies read": "Guess", "replies hidden": "Blind"}


def games(n: int, seed: int, held_out: bool = False) -> list[dict]:
    """n records, each a game's seed (and its number as the answer); one seed in four held out by a hash."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        s = rng.randrange(10 ** 9)
        if (zlib.crc32(str(s).encode()) % 4 == 0) == held_out:
            out.append({"prompt": PROMPT, "answer": str(random.Random(s).randint(1, 100)), "seed": s})
    return out


def play(target: int, read: bool, rng) -> list[tuple[int, str]]:
    """A transcript's guesses and replies: binary search on the replies, or guesses at random."""
    low, high, out = 1, 100, []
    while len(out) < LIMIT and (not out or out[-1][1] != "right"):
        n = (low + high) // 2 if read else rng.randint(1, 100)
        reply = "right" if n == target else "higher" if n < target else "lower"
        low, high = (n + 1, high) if reply == "higher" else (low, n - 1) if reply == "lower" else (low, high)
        out.append((n, reply))
    return out


def transcript(tok, tools, ex: dict, read: bool, system: str, rng):
    """(prompt text, completion ids, train mask): each guess a call turn (to its EOS), its reply between them as
    grpo.py's loop appends it (grpo.tool_turn), mask 0 there; the episode ends with a win or the 7th guess."""
    eos, ids, mask = [tok.eos_token_id], [], []
    for n, reply in play(int(ex["answer"]), read, rng):
        call = {"name": "guess", "arguments": {"n": n}}
        own = tok("<tool_call>\n" + json.dumps(call) + "\n</tool_call>", add_special_tokens=False).input_ids + eos
        result = grpo.tool_turn(tok, eos, [{**call, "result": reply}], 10 ** 6)
        ids += own + result
        mask += [1.0] * len(own) + [0.0] * len(result)
    end = len(ids) - len(result)  # (after the last guess: the episode is over, no reply follows)
    return grpo.chat_prompt(tok, ex["prompt"], system, tools), ids[:end], mask[:end]


def warm_start(train, steps, seed=0) -> str:
    """The supervised warm start (module docstring), on two threads: its folder, named by its settings and
    kept there, so that a rerun (another RL protocol) reuses it."""
    settings = dict(model=MODEL, vocab=VOCAB, games=len(train), read_share=READ_SHARE, steps=steps,
                    batch=WARM_BATCH, lr=WARM_LR, schedule="constant", threads=2, seed=seed)
    model_dir = os.path.join(OUT, f"env_warm_{zlib.crc32(json.dumps(settings).encode()):08x}")
    done = os.path.join(model_dir, "warm.json")  # written last: a folder without it is retrained
    if os.path.exists(done):
        print(f"  warm start: {model_dir} (kept)", flush=True)
        return model_dir
    torch.set_num_threads(2)  # (1.7x as fast as one on idle cores, 4x as slow when other work shares them)
    rng = random.Random(seed)
    flags = ["--env", f"{GAME}:Guess", "--max-new-tokens", str(T), "--system-prompt", ""]  # (as the runs)
    tok = tiny.make_tokenizer(chat_template=tiny.TOOLS_CHAT_TEMPLATE)
    a = grpo.parse_args(flags)
    tools = grpo.load_tools(a, tok)
    corpus = [p + tok.decode(ids) for p, ids, _ in (transcript(tok, tools, ex, rng.random() < READ_SHARE,
                                                               a.system_prompt, rng) for ex in train[:2000])]
    grpo.end_worker(tools)
    tiny.make_tiny(model_dir, seed=seed, vocab=VOCAB, corpus=corpus, chat_template=tiny.TOOLS_CHAT_TEMPLATE, **MODEL)
    a = grpo.parse_args(["--model", model_dir, "--lora-r", "0", "--dtype", "fp32"] + flags)
    model, tok, _ = grpo.load_model(a, torch.device("cpu"))
    tools = grpo.load_tools(a, tok)
    grpo.end_worker(tools)
    cut = lt.shared_prefix(tok, [grpo.chat_prompt(tok, PROMPT, a.system_prompt, tools)] * 2)
    opt = torch.optim.AdamW(model.parameters(), lr=WARM_LR)
    t0 = time.time()
    for step in range(1, steps + 1):
        rows = [transcript(tok, tools, ex, rng.random() < READ_SHARE, a.system_prompt, rng)
                for ex in (rng.choice(train) for _ in range(WARM_BATCH))]
        loss = lt.sft_loss(model, tok, rows, cut)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 100 == 0 or step == steps:
            print(f"  warm start: step {step} ({time.time() - t0:.0f} s): loss {loss.item():.3f}", flush=True)
    model.save_pretrained(model_dir)
    with open(done, "w") as f:
        json.dump(settings, f)
    return model_dir


def run_grpo(name, seed, model_dir, paths, steps, eval_prompts):
    """grpo.py's run: held-out success at the start and at the end, greedy and sampled (as the run samples:
    EVAL_SAMPLES games a number), the mean reward (wins) at the first step and over the last 5, its
    wall-clock."""
    out = os.path.join(OUT, f"env_{RUNS[name]}_seed{seed}")
    flags = ["--prompts-per-step", str(B), "--num-generations", str(G), "--max-new-tokens", str(T), "--lora-r",
             "16", "--learning-rate", str(LR), "--warmup-steps", str(WARMUP), "--max-steps", str(steps),
             "--micro-batch-size", str(B * G), "--dtype", "fp32", "--eval-prompts", str(eval_prompts),
             "--eval-every", str(steps), "--eval-samples", str(EVAL_SAMPLES), "--save-every", "0", "--algo",
             "drgrpo", "--system-prompt", "", "--env", f"{GAME}:{RUNS[name]}", "--reward-fn", f"{GAME}:won"]
    wall = lt.child([sys.executable, os.path.join(ROOT, "grpo.py"), "--model", model_dir, "--dataset", paths[0],
                     "--eval-dataset", paths[1], "--output-dir", out, "--seed", str(seed), "--overwrite"] + flags,
                    f"{name} (seed {seed})")
    print(f"  {name} (seed {seed}): {wall / 60:.1f} min", flush=True)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    evals = [r for r in rows if "eval/accuracy" in r]
    steps_ = [r for r in rows if "reward/mean" in r]
    return {"success": (evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]), "wall": wall,
            "sampled": tuple(evals[i][f"eval/mean@{EVAL_SAMPLES}"] for i in (0, -1)),
            "wins": (steps_[0]["reward/mean"], statistics.mean(r["reward/mean"] for r in steps_[-5:]))}


def mean_se(xs, binomial=0):  # the mean and its standard error over seeds, never below binomial's
    spread = statistics.variance(xs) / len(xs) if len(xs) > 1 else 0.0
    floor = statistics.mean(x * (1 - x) for x in xs) / binomial / len(xs) if binomial else 0.0
    return statistics.mean(xs), math.sqrt(max(spread, floor))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--smoke", action="store_true", help="a few steps of each part: it runs, nothing measured")
    args = p.parse_args(argv)
    warm_steps, steps, n_eval = (2, 2, 8) if args.smoke else (WARM_STEPS, STEPS, EVAL_PROMPTS)
    os.makedirs(OUT, exist_ok=True)
    t0 = time.time()
    train, evals = games(N_TRAIN, 0), games(n_eval, 1, held_out=True)
    paths = [os.path.join(OUT, f) for f in ("env_train.jsonl", "env_eval.jsonl")]
    for path, rows in zip(paths, (train, evals)):
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    model_dir = warm_start(train, warm_steps)
    warm_min = (time.time() - t0) / 60
    print(f"  warm start: {warm_min:.1f} min", flush=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two cores: two runs at a time, a thread each
        futures = {(name, s): pool.submit(run_grpo, name, s, model_dir, paths, steps, n_eval)
                   for s in seeds for name in RUNS}
        results = {job: f.result() for job, f in futures.items()}
    minutes = (time.time() - t0) / 60
    note = (f"{n_eval} held-out games, greedy, and {EVAL_SAMPLES} sampled a game; seeds {seeds}; warm start "
            f"{warm_steps} steps ({warm_min:.1f} min); {minutes:.1f} min in all")
    md = "\n".join(tables(results, n_eval) + ["", note])
    print(md, flush=True)
    with open(os.path.join(OUT, "env.md"), "w") as f:
        f.write(md + "\n")
    return results


def tables(results, n_eval) -> list[str]:
    """A row a run, then each setting's success over its seeds with standard errors (mean_se)."""
    table = ["| run | seed | held-out success, greedy: start | end | sampled: start | end | wins: step 1 | "
             "last 5 steps | wall-clock (min) |", "| --- " * 9 + "|"]
    for (name, seed), r in results.items():
        cells = [*r["success"], *r["sampled"]]
        table.append(f"| {name} | {seed} | " + " | ".join(f"{x:.3f}" for x in cells)
                     + f" | {r['wins'][0]:.2f} | {r['wins'][1]:.2f} | {r['wall'] / 60:.1f} |")
    summary = ["| run | held-out success | start | end | rise (points) |", "| --- " * 5 + "|"]
    for name in RUNS:
        for key, how, games in (("success", "greedy", n_eval), ("sampled", "sampled", n_eval * EVAL_SAMPLES)):
            rs = [r[key] for (run, _), r in results.items() if run == name]
            (s, s_se), (e, e_se) = (mean_se([r[i] for r in rs], games) for i in (0, 1))
            rise, rise_se = mean_se([r[1] - r[0] for r in rs])
            rise_se = max(rise_se, math.hypot(s_se, e_se) if len(rs) == 1 else 0.0)
            summary.append(f"| {name} | {how} | {s:.3f} ± {s_se:.3f} | {e:.3f} ± {e_se:.3f} | "
                           f"{100 * rise:+.1f} ± {100 * rise_se:.1f} |")
    return table + [""] + summary


if __name__ == "__main__":
    main()
