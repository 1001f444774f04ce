"""Same numbers: a refactor of grpo.py left every logged number as it was.

Runs 14 small configurations of grpo.py (every preset, GSPO, CISPO, SAPO, dual-clip, the off-policy KL, full
fine-tuning, the mixed pool, top-k groups, TIS with overlong filtering, bf16 micro-batches of one) twice: with
grpo.py, rewards.py and tiny.py of a base revision, and with those of the head, each copied into a directory
of its own. Both use one tiny model (built by the head's tiny.py), one reward and the same data, so only the
code differs. For each configuration it compares:
  - metrics.jsonl and samples.jsonl, row by row, every key but the timings (time/*, tokens_per_second),
    exactly (==, NaN equal to NaN);
  - the final weights, checkpoint/adapter_model.safetensors (or model.safetensors), bitwise.
A key the head logs and the base does not is an added key (listed, not a failure); a key the base logs and
the head does not is a failure, as is any differing value, row count or weight, or a run that fails.

    python bench/same_numbers.py                          # bb2a858 against the working tree, uncommitted too
    python bench/same_numbers.py --base HEAD~1 --head HEAD
    python bench/same_numbers.py --only dapo,top-k --keep # some configurations; keep the runs' directories
    python bench/same_numbers.py --renamed loss=loss/token_mean  # base's `loss` is head's loss/token_mean

Run it from the repository (any directory inside it). 28 runs, two at a time, one thread each: 4 to 6 minutes
on 2 cores shared with other work (a run alone: about 7 s). Exit status 1 when something differs.

The tiny model is tilted towards EOS (its <|im_end|> embedding moved along the mean final hidden state), so
that about half the completions end before --max-new-tokens: otherwise a random model never stops, and
--mask-truncated and the overlong penalty see only truncated completions. The reward is correctness plus
a dense one (digits / 10), so that groups have unequal rewards. After each line, a note says when a
configuration's feature did not fire in the head's run (say dynamic sampling never sampled again). The data
are small JSONL files, not the built-in task: its problems changed at ada27a9 (held out by a hash).
"""
import argparse
import concurrent.futures
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

FILES = ("grpo.py", "rewards.py", "tiny.py")
TIMING = ("time/", "tokens_per_second")
STEPS = 3
TINY = ["--max-steps", str(STEPS), "--max-new-tokens", "12", "--prompts-per-step", "2",
        "--num-generations", "4", "--eval-prompts", "4", "--eval-every", "2", "--micro-batch-size", "3",
        "--learning-rate", "1e-3", "--log-samples", "2", "--save-every", "0"]
SUMS = [(2, 3), (4, 5), (7, 1), (6, 6), (8, 2), (9, 4)]  # the training prompts: What is a + b?
EVAL_SUMS = [(1, 1), (3, 3), (5, 2), (2, 7)]
REWARD = "def digits(c, a, **kw):\n    return sum(ch.isdigit() for ch in c) / 10\n"


def values(rows, key):
    return [r[key] for r in rows if key in r]


def ratio_moved(metrics):  # pi / pi_old != 1 somewhere: a second update on the batch moved the policy
    return any(r != 1 for r in values(metrics, "loss/ratio"))


def drops_a_first_group(samples):  # a dropped group's rows (no advantage), then a kept one's, in one step
    return any(a["adv"] is None and b["adv"] is not None and a["step"] == b["step"]
               for a, b in zip(samples, samples[1:]))


# name, flags after the common ones (TINY, data, reward), what shows that the feature fired in the head's run,
# and that test on (metrics rows, samples rows). A larger learning rate where the clip must bite.
CONFIGS = [
    ("grpo", ["--algo", "grpo"],
     "KL to the reference > 0", lambda m, s: max(values(m, "kl")) > 0),
    ("drgrpo", ["--algo", "drgrpo"],
     "trained rows", lambda m, s: max(values(m, "train/rows")) > 0),
    ("dapo", ["--algo", "dapo", "--rewards", "correct_pm1", "--num-generations", "2"],  # G 2: equal groups
     "a second sampling round", lambda m, s: max(values(m, "groups/gen_rounds")) > 1),
    ("drgrpo_soft", ["--algo", "drgrpo_soft"],
     "a soft weight < 1", lambda m, s: min(values(m, "adv/soft_weight_min")) < 1),
    ("gspo", ["--ratio", "sequence", "--num-iterations", "2"],
     "a ratio != 1", lambda m, s: ratio_moved(m)),
    ("cispo", ["--surrogate", "cispo", "--num-iterations", "2", "--learning-rate", "1e-2"],
     "clipping", lambda m, s: max(values(m, "loss/clipfrac_low") + values(m, "loss/clipfrac_high")) > 0),
    ("sapo", ["--surrogate", "sapo", "--num-iterations", "2"],
     "a ratio != 1", lambda m, s: ratio_moved(m)),
    ("dual-clip", ["--dual-clip", "1.05", "--num-iterations", "2", "--learning-rate", "1e-2"],
     "a dual-clipped token", lambda m, s: max(values(m, "loss/dual_clipfrac")) > 0),
    ("kl-off-policy", ["--beta", "0.1", "--kl", "k3_ratio", "--num-iterations", "2"],
     "KL > 0 and a ratio != 1", lambda m, s: max(values(m, "kl")) > 0 and ratio_moved(m)),
    ("full-ft", ["--lora-r", "0", "--beta", "0.04"],
     "KL to the frozen reference > 0", lambda m, s: max(values(m, "kl")) > 0),
    ("mixed-pool", ["--teacher-pool", "{pool}", "--teacher-per-group", "2", "--split-grads"],
     "teacher rows, both gradients", lambda m, s: any(r["teacher"] for r in s)
     and min(values(m, "grad/norm_teacher")) > 0 and min(values(m, "grad/norm_student")) > 0),
    ("top-k", ["--top-k-groups", "1", "--prompts-per-step", "2"],
     "a step that drops its first group", lambda m, s: drops_a_first_group(s)),
    ("tis-mask-truncated", ["--tis", "2", "--mask-truncated"],
     "truncated and ended completions", lambda m, s: 0 < min(values(m, "completion/truncated_frac")) < 1),
    ("mb1-bf16", ["--micro-batch-size", "1", "--dtype", "bf16"],
     "trained rows", lambda m, s: max(values(m, "train/rows")) > 0),
]


def git(repo, *args, **kw):
    return subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True, **kw).stdout


def materialise(repo, rev, dest):
    """grpo.py, rewards.py and tiny.py of a revision (None: the working tree, uncommitted changes too)."""
    os.makedirs(dest)
    if rev is None:
        for name in FILES:
            shutil.copy(os.path.join(repo, name), dest)
    else:
        subprocess.run(["tar", "-x", "-C", dest], input=git(repo, "archive", rev, *FILES), check=True)


def make_inputs(code_dir, work):
    """The tiny model (code_dir's tiny.py, tilted towards EOS), the reward file, data, held-out data, pool."""
    import transformers
    transformers.utils.logging.disable_progress_bar()  # (the model's save and load)
    spec = importlib.util.spec_from_file_location("tiny", os.path.join(code_dir, "tiny.py"))
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    model = tiny.make_tiny(os.path.join(work, "model"))
    tilt_towards_eos(model, boost=3.0)
    paths = {name: os.path.join(work, name) for name in ("rw.py", "data.jsonl", "eval.jsonl", "pool.jsonl")}
    with open(paths["rw.py"], "w") as f:
        f.write(REWARD)
    for name, sums in (("data.jsonl", SUMS), ("eval.jsonl", EVAL_SUMS)):
        write_jsonl(paths[name], [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in sums])
    pool = []  # three a prompt, two drawn a group; each at most 11 characters (12 byte tokens with EOS)
    for a, b in SUMS:
        for completion, reward in ((f"\\boxed{{{a + b}}}", 1.2), (str(a + b - 1), 0.1), ("unsure", 0.0)):
            pool.append({"prompt": f"What is {a} + {b}?", "completion": completion, "reward": reward})
    write_jsonl(paths["pool.jsonl"], pool)
    return model, paths


def tilt_towards_eos(path, boost):
    """Adds about `boost` to EOS's logit: its (tied) embedding moves along the mean final hidden state."""
    import torch
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    texts = [tok.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}?"}], tokenize=False,
                                     add_generation_prompt=True) for a, b in SUMS]
    enc = tok(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        hidden = model.get_decoder()(**enc).last_hidden_state[enc.attention_mask.bool()]  # (tokens, H)
        mean = hidden.mean(0)
        model.get_input_embeddings().weight[tok.eos_token_id] += boost * mean / mean.dot(mean)
    model.save_pretrained(path)


def write_jsonl(path, records):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def run(code_dir, out, flags):
    """One grpo.py run as a subprocess of its own, in its revision's directory: (seconds, error or None)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.time()
    try:
        p = subprocess.run([sys.executable, os.path.join(code_dir, "grpo.py"), "--output-dir", out, *flags],
                           cwd=code_dir, env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return time.time() - t0, "no end in 600 s"
    error = None if p.returncode == 0 else f"exit {p.returncode}: {p.stderr.strip()[-600:]}"
    return time.time() - t0, error


def read_jsonl(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def same(x, y):
    """==, with NaN equal to NaN, into lists and dicts (samples' per-reward values)."""
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(same(a, b) for a, b in zip(x, y))
    return x == y


def renamed_row(row, renamed):
    """The head's row with each NEW key under its OLD name (renamed: {OLD: NEW}); a head key that is itself
    an OLD name (reused with another meaning) becomes 'OLD (head's)', an added key."""
    out = {k + " (head's)" if k in renamed else k: v for k, v in row.items()}
    for old, new in renamed.items():
        if new in row:
            out[old] = out.pop(new)
    return out


def compare_rows(name, base, head, result, renamed):
    """Adds to result: differing values by key ([(step, base's, head's)]), other differences, missing keys,
    added keys. name: the log's, which prefixes its keys."""
    head = [renamed_row(h, renamed) for h in head]
    if len(base) != len(head):
        result["other"].append(f"{name}: {len(base)} rows in the base, {len(head)} in the head")
    for b, h in zip(base, head):
        for key in [k for k in {**b, **h} if not k.startswith(TIMING)]:
            if key not in h:
                result["missing"].add(f"{name}:{key}")
            elif key not in b:
                result["added"].add(f"{name}:{key}")
            elif not same(b[key], h[key]):
                result["values"].setdefault(f"{name}:{key}", []).append((b.get("step"), b[key], h[key]))


def weights_file(out):
    for name in ("adapter_model.safetensors", "model.safetensors"):
        path = os.path.join(out, "checkpoint", name)
        if os.path.exists(path):
            return path
    return None


def compare_weights(base_out, head_out, result):
    b, h = weights_file(base_out), weights_file(head_out)
    if b is None or h is None or os.path.basename(b) != os.path.basename(h):
        result["other"].append(f"weights: base {b and os.path.basename(b)}, head {h and os.path.basename(h)}")
        return
    with open(b, "rb") as fb, open(h, "rb") as fh:
        if fb.read() == fh.read():
            return
    import torch
    from safetensors.torch import load_file  # which tensors differ (a header alone may differ, too)
    tb, th = load_file(b), load_file(h)
    def bits(t):
        return t.contiguous().view(-1).view(torch.uint8)
    names = sorted(set(tb) | set(th))
    bad = [n for n in names if n not in tb or n not in th or tb[n].dtype != th[n].dtype
           or tb[n].shape != th[n].shape or not torch.equal(bits(tb[n]), bits(th[n]))]
    result["other"].append(f"weights: {len(bad)} of {len(names)} tensors differ, e.g. {bad[:2]}"
                           if bad else "weights: the tensors are equal, the files' bytes are not")


def compare(base_out, head_out, renamed):
    result = {"values": {}, "other": [], "missing": set(), "added": set()}
    rows = 0
    for log in ("metrics.jsonl", "samples.jsonl"):
        base, head = read_jsonl(os.path.join(base_out, log)), read_jsonl(os.path.join(head_out, log))
        compare_rows(log.split(".")[0], base, head, result, renamed)
        rows += min(len(base), len(head))
    compare_weights(base_out, head_out, result)
    return rows, result


def fired(test, out):
    """Whether the configuration's feature showed in this run's logs (None: they do not say)."""
    try:
        return bool(test(read_jsonl(os.path.join(out, "metrics.jsonl")),
                         read_jsonl(os.path.join(out, "samples.jsonl"))))
    except (KeyError, ValueError, TypeError):  # a key this revision does not log
        return None


def differences(result, n=3):
    """The first n differing keys, each with its count of rows and its first values; then the others."""
    out = [f"{key} in {len(diffs)} rows (step {diffs[0][0]}: {diffs[0][1]!r} != {diffs[0][2]!r})"
           for key, diffs in list(result["values"].items())[:n]]
    if len(result["values"]) > n:
        out.append(f"{len(result['values']) - n} more keys")
    return "; ".join(out + result["other"])


def shorten(keys, n=6):
    keys = sorted(keys)
    return ", ".join(keys[:n]) + (f" (+{len(keys) - n} more)" if len(keys) > n else "")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="bb2a858", help="the revision whose numbers are the reference")
    head = parser.add_mutually_exclusive_group()
    head.add_argument("--head", help="a revision to compare (default: the working tree)")
    head.add_argument("--head-tree", action="store_true",
                      help="the working tree, uncommitted changes too (the default)")
    parser.add_argument("--only", default="", help="comma-separated configuration names (default: all)")
    parser.add_argument("--renamed", action="append", default=[], metavar="OLD=NEW",
                        help="the head logs the base's key OLD as NEW: compare those (repeatable)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one thread each")
    parser.add_argument("--keep", action="store_true", help="keep the runs' directory (its path is printed)")
    args = parser.parse_args()
    repo = git(os.getcwd(), "rev-parse", "--show-toplevel", text=True).strip()
    renamed = dict(pair.split("=", 1) for pair in args.renamed)
    configs = [c for c in CONFIGS if not args.only or c[0] in args.only.split(",")]
    if args.only and len(configs) != len(args.only.split(",")):
        sys.exit(f"--only: the configurations are {', '.join(c[0] for c in CONFIGS)}")
    base_name = git(repo, "rev-parse", "--short", args.base, text=True).strip()
    head_name = (git(repo, "rev-parse", "--short", args.head, text=True).strip() if args.head else
                 "the working tree at " + git(repo, "rev-parse", "--short", "HEAD", text=True).strip())
    work = tempfile.mkdtemp(prefix="same_numbers_")
    t0 = time.time()
    failed = 0
    try:
        code = {"base": os.path.join(work, "base"), "head": os.path.join(work, "head")}
        materialise(repo, args.base, code["base"])
        materialise(repo, args.head, code["head"])
        model, paths = make_inputs(code["head"], work)
        common = ["--model", model, "--dataset", paths["data.jsonl"], "--eval-dataset", paths["eval.jsonl"],
                  "--reward-fn", paths["rw.py"] + ":digits", "--rewards", "correct"] + TINY
        print(f"base {base_name}, head {head_name}: {len(configs)} configurations, {STEPS} steps each "
              f"(runs in {work})", flush=True)
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            futures = {}
            for name, flags, _, _ in configs:
                flags = common + [f.format(pool=paths["pool.jsonl"]) for f in flags]
                for side in ("base", "head"):
                    out = os.path.join(work, "runs", name, side)
                    futures[name, side] = pool.submit(run, code[side], out, flags)
            for name, _, feature, test in configs:
                outs = {side: os.path.join(work, "runs", name, side) for side in ("base", "head")}
                (tb, err_b), (th, err_h) = futures[name, "base"].result(), futures[name, "head"].result()
                if err_b or err_h:
                    failed += 1
                    print(f"{name:20} FAILED  base: {err_b or 'ran'}", flush=True)
                    print(f"{'':22}head: {err_h or 'ran'}", flush=True)
                    continue
                rows, result = compare(outs["base"], outs["head"], renamed)
                bad = result["values"] or result["other"] or result["missing"]
                failed += bool(bad)
                line = f"{name:20} {'DIFFERS' if bad else 'same':8} {rows:3} rows  ({tb:.0f} s, {th:.0f} s)"
                if result["values"] or result["other"]:
                    line += "  " + differences(result)
                print(line)
                if result["missing"]:
                    print(f"{'':22}missing in the head: {shorten(result['missing'])}")
                if result["added"]:
                    print(f"{'':22}added by the head: {shorten(result['added'])}")
                shown = fired(test, outs["head"])
                if not shown:
                    print(f"{'':22}note: the feature did not show ({feature})" if shown is False else
                          f"{'':22}note: the head's logs cannot say whether it fired ({feature})")
                sys.stdout.flush()
        verdict = "the same numbers" if not failed else f"{failed} of {len(configs)} differ or failed"
        print(f"{verdict}: base {base_name}, head {head_name}; {len(configs)} configurations in "
              f"{time.time() - t0:.0f} s")
    finally:
        if args.keep:
            print(f"kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
