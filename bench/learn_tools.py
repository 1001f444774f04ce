"""Does RL with a tool learn what the model cannot do without it? Held-out accuracy on multi-digit multiplication,
from a supervised warm start that sometimes calls the calculator, with --tools calculator and without, on a CPU.
Protocol and results: bench/README.md.

    python bench/learn_tools.py               # warm start, then 2 runs x 3 seeds, two at a time
    python bench/learn_tools.py --seeds 0     # one seed each

Writes bench/out/tools.md (the tables).

The task: the built-in task's multiplication word problem ("Ava buys 37 boxes with 481 pens in each. How many pens
is that?") with two factors of 2 or 3 digits; one problem in four (its two factors, in either order) is held out
by a hash, as the built-in task does, so no evaluation problem is a training problem. A 4-layer, 128-wide Qwen2
cannot multiply such numbers; it can learn to copy them into a call. The warm start: that model (tiny.py, its
tools chat template, a BPE learnt from the transcripts) fine-tuned on transcripts rendered by the template, with
the calculator's schema in the prompt as `--tools calculator` renders it: CALL_SHARE of them call the calculator
and state its result (`\\boxed{17797}`), the rest answer directly (`37 * 481 = 17797. The answer is
\\boxed{17797}.`), which the model cannot learn to do right. Loss on the model's turns only (the tool's turn is
conditioning, as in the RL runs). Then grpo.py from it, the same flags with and without `--tools calculator`:
held-out greedy accuracy by grpo.py's own `evaluate` (with the tool when it is on) before the first step and after
the last; the share of sampled completions that write a call (`<tool_call>`) at the first step and over the last
ones. Runs go two at a time, one thread each; each is seeded, so a rerun repeats it.
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
import zlib

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import grpo  # noqa: E402
import tiny  # noqa: E402

OUT = os.path.join(ROOT, "bench", "out")
MODEL, VOCAB = dict(layers=4, hidden=128, heads=4, kv_heads=2), 1024
N_TRAIN, EVAL_PROMPTS, CALL_SHARE = 20000, 256, 0.3
WARM_STEPS, WARM_BATCH, WARM_LR, CHECK_EVERY = 1000, 32, 2e-3, 200
B, G, T, LR, WARMUP, STEPS, LAST = 8, 8, 96, 5e-4, 5, 40, 5
RL = ["--prompts-per-step", str(B), "--num-generations", str(G), "--max-new-tokens", str(T), "--lora-r", "16",
      "--learning-rate", str(LR), "--warmup-steps", str(WARMUP), "--max-steps", str(STEPS), "--micro-batch-size",
      str(B * G), "--dtype", "fp32", "--eval-prompts", str(EVAL_PROMPTS), "--eval-every", str(STEPS),
      "--save-every", "0", "--algo", "drgrpo", "--log-samples", str(B)]
RUNS = {"RL with the calculator": ["--tools", "calculator"], "RL without it": []}
NAMES, THINGS = ["Ava", "Ben", "Chen", "Dana", "Eli", "Fatima", "Gus", "Hana"], ["apples", "pens", "coins", "cards"]


def problems(n: int, seed: int, held_out: bool = False) -> list[dict]:
    """n seeded multiplication word problems, each factor of 2 or 3 digits (as likely); one problem in four is
    held out by a hash of its factors (in either order); held-out problems each once."""
    rng, out, seen = random.Random(seed), [], set()
    while len(out) < n:
        who, what = rng.choice(NAMES), rng.choice(THINGS)
        x, y = (rng.randint(10, 99) if rng.random() < 0.5 else rng.randint(100, 999) for _ in range(2))
        problem = (min(x, y), max(x, y))
        if (zlib.crc32(repr(problem).encode()) % 4 == 0) != held_out or held_out and problem in seen:
            continue
        seen.add(problem)
        out.append({"prompt": f"{who} buys {x} boxes with {y} {what} in each. How many {what} is that?",
                    "answer": str(x * y)})
    return out


def split_files():
    train, evals = problems(N_TRAIN, 0), problems(EVAL_PROMPTS, 1, held_out=True)
    paths = [os.path.join(OUT, f) for f in ("tools_train.jsonl", "tools_eval.jsonl")]
    for path, rows in zip(paths, (train, evals)):
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return train, evals, paths


def turns(ex: dict, call: bool) -> list[tuple[str, str]]:
    """The assistant's turns of a transcript: ("call", expression) then ("say", text), or ("say", text)."""
    x, y = re.findall(r"\d+", ex["prompt"])[:2]
    if call:
        return [("call", f"{x} * {y}"), ("say", f"The answer is \\boxed{{{ex['answer']}}}.")]
    return [("say", f"{x} * {y} = {ex['answer']}. The answer is \\boxed{{{ex['answer']}}}.")]


def transcript(tok, tools, ex: dict, call: bool, system: str):
    """(prompt text, completion ids, train mask): the model's turns as the template renders an assistant's
    (a call turn ends at its EOS), the calculator's result between them as grpo.py's loop appends it
    (grpo.tool_turn), mask 0 there."""
    prompt = grpo.chat_prompt(tok, ex["prompt"], system, tools)
    eos = [tok.eos_token_id]
    ids, mask = [], []
    for kind, text in turns(ex, call):
        if kind == "call":
            call_ = {"name": "calculator", "arguments": {"expression": text}}
            text = "<tool_call>\n" + json.dumps(call_) + "\n</tool_call>"
        own = tok(text, add_special_tokens=False).input_ids + eos
        ids += own
        mask += [1.0] * len(own)
        if kind == "call":
            result = tool_result(tok, eos, call_)
            ids += result
            mask += [0.0] * len(result)
    return prompt, ids, mask


def tool_result(tok, eos, call):
    import rewards
    return grpo.tool_turn(tok, eos, [{**call, "result": rewards.calculator(**call["arguments"])}], 10 ** 6)


def shared_prefix(tok, prompts: list[str]) -> int:
    """Characters every prompt shares, cut after the system turn's EOS (a special token: ids split there)."""
    common = os.path.commonprefix(prompts)
    return common.rindex(tok.eos_token) + len(tok.eos_token)


def sft_loss(model, tok, rows, cut: int):
    """Mean log-loss on the trained tokens of rows [(prompt, ids, mask)], whose prompts share their first cut
    characters: that prefix goes through the model once, its KV cache repeated for every row (same loss as
    one forward a row, at a third of the tokens)."""
    prefix = tok(rows[0][0][:cut], add_special_tokens=False, return_tensors="pt").input_ids
    out = model(prefix, use_cache=True)
    cache = out.past_key_values
    cache.batch_repeat_interleave(len(rows))
    seqs, trains = [], []
    for prompt, ids, mask in rows:
        rest = tok(prompt[cut:], add_special_tokens=False).input_ids
        seqs.append(rest + ids)
        trains.append([0.0] * len(rest) + mask)
    S = max(map(len, seqs))
    ids = torch.full((len(rows), S), tok.pad_token_id)
    mask = torch.zeros(len(rows), S)
    for r, (seq, train) in enumerate(zip(seqs, trains)):
        ids[r, :len(seq)] = torch.tensor(seq)  # right-padded: causal, so padding changes nothing before it
        mask[r, :len(seq)] = torch.tensor(train)
    L = prefix.shape[1]
    logits = model(ids, past_key_values=cache, position_ids=torch.arange(L, L + S)[None].expand(len(rows), -1),
                   attention_mask=torch.ones(len(rows), L + S, dtype=torch.long)).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    return -(logp * mask[:, 1:]).sum() / mask[:, 1:].sum()


def check(model, tok, tools, evals, a) -> dict:
    """Sampled completions (4 a prompt) of 32 held-out prompts through grpo.py's loop with the calculator: the
    share that call, and the accuracy of those that call and of those that do not."""
    from rewards import is_correct
    rows = [{"record": ex} for ex in evals[:32] for _ in range(4)]  # (generate renders each prompt)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        grpo.generate(model, tok, rows, a, tools=tools)
    right = [is_correct(r["text"], r["record"]["answer"]) for r in rows]  # the model's tokens, no tool's
    called = [bool(r["tool_calls"]) for r in rows]

    def share(xs):
        return statistics.mean(xs) if xs else math.nan
    return {"calls": share(called), "right if it calls": share([r for r, c in zip(right, called) if c]),
            "right if not": share([r for r, c in zip(right, called) if not c])}


def warm_start(model_dir, train, evals, seed=0):
    """The supervised warm start (see the module docstring), on one thread as each run (two threads on a busy
    machine were 5x slower); returns its log: [(step, check())]."""
    torch.set_num_threads(1)
    a = grpo.parse_args(["--tools", "calculator", "--max-new-tokens", str(T)])
    torch.manual_seed(seed)
    tok = tiny.make_tokenizer(chat_template=tiny.TOOLS_CHAT_TEMPLATE)
    tools = grpo.load_tools(a, tok)
    rng = random.Random(seed)
    corpus = [grpo.chat_prompt(tok, ex["prompt"], a.system_prompt, tools) + tok.decode(
        transcript(tok, tools, ex, rng.random() < 0.5, a.system_prompt)[1]) for ex in train[:2000]]
    tiny.make_tiny(model_dir, seed=seed, vocab=VOCAB, corpus=corpus, chat_template=tiny.TOOLS_CHAT_TEMPLATE, **MODEL)
    a = grpo.parse_args(["--model", model_dir, "--lora-r", "0", "--dtype", "fp32", "--max-new-tokens", str(T),
                         "--tools", "calculator"])
    model, tok, _ = grpo.load_model(a, torch.device("cpu"))
    tools = grpo.load_tools(a, tok)
    cut = shared_prefix(tok, [grpo.chat_prompt(tok, ex["prompt"], a.system_prompt, tools) for ex in train[:100]])
    opt = torch.optim.AdamW(model.parameters(), lr=WARM_LR)
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 100))
    log, t0 = [], time.time()
    for step in range(1, WARM_STEPS + 1):
        rows = [transcript(tok, tools, ex, rng.random() < CALL_SHARE, a.system_prompt)
                for ex in (rng.choice(train) for _ in range(WARM_BATCH))]
        loss = sft_loss(model, tok, rows, cut)
        loss.backward()
        opt.step()
        opt.zero_grad()
        warmup.step()
        if step % CHECK_EVERY == 0 or step == WARM_STEPS:
            log.append((step, check(model, tok, tools, evals, a)))
            print(f"  warm start: step {step} ({time.time() - t0:.0f} s): loss {loss.item():.3f}, "
                  + ", ".join(f"{k} {v:.2f}" for k, v in log[-1][1].items()), flush=True)
    model.save_pretrained(model_dir)
    return log


def child(cmd, what):
    """One run in its own process, on one thread; if it fails, its own last lines say why. Its wall-clock."""
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if p.returncode:
        raise SystemExit(f"bench/learn_tools.py: {what} failed:\n{p.stderr[-2000:]}")
    return time.time() - t0


def run_grpo(name, seed, model_dir, paths):
    """grpo.py's run: held-out greedy accuracy at the start and the end, the share of completions that call at
    the first step and over the last LAST, and its wall-clock."""
    out = os.path.join(OUT, f"tools_{name.split()[2]}_seed{seed}")
    wall = child([sys.executable, os.path.join(ROOT, "grpo.py"), "--model", model_dir, "--dataset", paths[0],
                  "--eval-dataset", paths[1], "--output-dir", out, "--seed", str(seed), "--overwrite"] + RL
                 + RUNS[name], f"{name} (seed {seed})")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    accuracy = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if "reward/mean" in r]
    written = {}  # step -> [whether the completion writes a call], with or without a tool to run it
    for r in map(json.loads, open(os.path.join(out, "samples.jsonl"))):
        written.setdefault(r["step"], []).append("<tool_call>" in r["completion"])
    calls = [statistics.mean(written[r["step"]]) for r in steps]
    return {"accuracy": (accuracy[0], accuracy[-1]), "calls": (calls[0], statistics.mean(calls[-LAST:])),
            "reward": (steps[0]["reward/mean"], statistics.mean(r["reward/mean"] for r in steps[-LAST:])),
            "wall": wall}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    args = p.parse_args()
    os.makedirs(OUT, exist_ok=True)
    t0 = time.time()
    train, evals, paths = split_files()
    model_dir = os.path.join(OUT, "tools_warm")
    warm = warm_start(model_dir, train, evals)
    warm_time = time.time() - t0
    print(f"warm start: {warm_time:.0f} s", flush=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    jobs = [(name, s) for s in seeds for name in RUNS]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two cores: two runs at a time, a thread each
        futures = {job: pool.submit(run_grpo, *job, model_dir, paths) for job in jobs}
        results = {job: f.result() for job, f in futures.items()}
    report(results, warm, warm_time, time.time() - t0, seeds)


def report(results, warm, warm_time, wall, seeds):
    n = EVAL_PROMPTS
    table = ["| run | seed | held-out greedy: start | end | share that calls: step 1 | last 5 steps | "
             "mean reward: step 1 | last 5 | run's wall-clock (min) |", "| --- " * 9 + "|"]
    for (name, seed), r in results.items():
        table.append(f"| {name} | {seed} | {r['accuracy'][0]:.3f} | {r['accuracy'][1]:.3f} | {r['calls'][0]:.2f} | "
                     f"{r['calls'][1]:.2f} | {r['reward'][0]:.2f} | {r['reward'][1]:.2f} | {r['wall'] / 60:.1f} |")

    def mean_se(xs, binomial=0):  # the mean and its standard error over seeds, never below binomial's
        spread = statistics.variance(xs) / len(xs) if len(xs) > 1 else 0.0
        floor = statistics.mean(x * (1 - x) for x in xs) / binomial / len(xs) if binomial else 0.0
        return statistics.mean(xs), math.sqrt(max(spread, floor))
    summary = ["| run | held-out greedy: start | end | rise (points) | share that calls: step 1 | last 5 steps | "
               "rise (points) |", "| --- " * 7 + "|"]
    for name in RUNS:
        rs = [results[(name, s)] for s in seeds]
        cells = []
        for key, binomial in (("accuracy", n), ("calls", B * G)):
            (s, s_se), (e, e_se) = (mean_se([r[key][i] for r in rs], binomial) for i in (0, 1))
            rise, rise_se = mean_se([r[key][1] - r[key][0] for r in rs])
            rise_se = max(rise_se, math.hypot(s_se, e_se) if len(rs) == 1 else 0.0)
            cells += [f"{s:.3f} ± {s_se:.3f}", f"{e:.3f} ± {e_se:.3f}", f"{100 * rise:+.1f} ± {100 * rise_se:.1f}"]
        summary.append(f"| {name} | " + " | ".join(cells) + " |")
    ends = {name: [results[(name, s)]["accuracy"][1] for s in seeds] for name in RUNS}
    (a_mean, a_se), (b_mean, b_se) = (mean_se(ends[name], n) for name in RUNS)
    last = warm[-1][1]
    md = "\n".join(table + [""] + summary + [
        "", f"end accuracy, with the tool minus without: {100 * (a_mean - b_mean):+.1f} ± "
            f"{100 * math.hypot(a_se, b_se):.1f} points", "",
        f"warm start: {warm[-1][0]} steps in {warm_time / 60:.1f} min; its check (32 held-out prompts x 4 samples, "
        f"with the calculator): calls {last['calls']:.2f}, right when it calls {last['right if it calls']:.2f}, "
        f"right when not {last['right if not']:.2f}; {n} held-out problems; seeds {seeds}; whole run "
        f"{wall / 60:.1f} min"])
    print(md, flush=True)
    with open(os.path.join(OUT, "tools.md"), "w") as f:
        f.write(md + "\n")


if __name__ == "__main__":
    main()
