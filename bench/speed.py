"""Speed and memory: grpo.py against TRL's GRPOTrainer and against the floor, on one workload.

    pip install -r bench/requirements.txt           # the bench's own extras, not grpo.py's
    python bench/speed.py                           # CPU: a small Qwen2 built locally (4 x 256, 259 tokens), fp32
    python bench/speed.py --real-width --dtype bf16 # CPU: Qwen2.5-0.5B's widths (vocab 151,936), 2 layers
    python bench/speed.py --device cuda             # GPU: Qwen2.5-0.5B's shape (24 layers), random weights, bf16:
                                                    # 8 x 8 x 256 tokens (the headline run's), then 2 x 8 x 64

Workload (every contender, same model, same reward): B prompts x G completions a step (4 x 8; 2 x 8
with --real-width), up to 64 new tokens, LoRA r16 on all linear layers, beta 0, Dr. GRPO loss (no
std, / (n_seq * T)), one optimizer step per rollout, gradient checkpointing on in both trainers
(TRL's GRPOConfig default; `--no-gc` turns it off in both, grpo.py's default). The floor never
checkpoints. The floor is what no GRPO trainer can beat: one batched HF `generate` of the same
completions and one forward/backward over them.

--real-width: the model has Qwen2.5-0.5B's widths (151,936-token vocabulary, hidden 896, 14 heads,
2 KV heads, MLP 4,864) with --layers layers, the tokenizer is padded to the whole vocabulary, and
prompts are GSM8K-length (about 190 tokens with the default system prompt and the chat template, as
a GSM8K question is in Qwen's tokenizer; this tokenizer spends one token per byte).

Two workloads: `graded` (a reward that differs within every group) and `binary` (0/1; 2 prompts in 5
always get 0 for every completion, so about 40% of groups have all-equal rewards, as on GSM8K).
Each contender runs in its own child process, interleaved A B C A B C ..., `--reps` times, each
time `--steps` timed steps after one untimed warm-up step. Printed: the median seconds per 1k
completion tokens, the ratio to TRL and to the floor, and peak memory (max RSS of the child; on
CUDA, the peak of torch's allocator, and grpo.py's peak while sampling and while training apart). A child
never outlives the benchmark (killed with it, and with all it started).

On a GPU: grpo.py samples with its compiled static-cache sampler (`--compile-generate auto`), TRL runs
twice, with its default sampler and with its fastest one short of vLLM (transformers' continuous
batching, `use_transformers_continuous_batching`, where the installed TRL has it), and each grpo.py row
gives its milliseconds per decode step beside the bandwidth limit (every bf16 weight read once a step,
plus the KV cache, at --bandwidth TB/s: an H100 SXM's HBM3 is 3.35).
"""
import argparse
import ctypes
import importlib.util
import json
import math
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import grpo  # noqa: E402
import tiny  # noqa: E402

B, G, T, LORA_R, LR = 4, 8, 64, 16, 1e-5
COMPILE = "auto"  # grpo.py's --compile-generate
SYSTEM, DTYPE = "", "fp32"  # --real-width: grpo.py's default system prompt; --dtype
PROMPTS = [f"Question {i}: what is {i} + {2 * i}? Think, then answer." for i in range(40)]
GSM8K_LENGTH = [f"Question {i}: Ava buys {i + 3} boxes of {2 * i + 5} pens and gives away {i + 2} pens. How many "
                f"pens does Ava have left?" for i in range(40)]


def graded(completion, answer, **kw):
    """Differs within every group: the share of digits among the first 32 characters, plus a byte hash."""
    head = completion[:32]
    return sum(c.isdigit() for c in head) / 32 + (sum(map(ord, head)) % 97) / 97


def binary(completion, answer, **kw):
    """0/1; prompts whose answer is 'never' always score 0 (an all-equal group)."""
    return 0.0 if answer == "never" else float(sum(map(ord, completion)) % 2)


def build(model_dir, real_width, layers):
    if not real_width:
        return tiny.make_tiny(model_dir, layers=4, hidden=256)
    return tiny.make_tiny(model_dir, layers=layers, **tiny.QWEN25_05B)  # random weights, padded tokenizer


def data(workload):
    return [{"prompt": p, "answer": "never" if workload == "binary" and i % 5 < 2 else "1"}
            for i, p in enumerate(PROMPTS)]


# ----------------------------------------------------------------------------- contenders (child processes)
GC = True  # gradient checkpointing in both trainers (TRL's default); --no-gc turns it off in both


def child_grpo(model_dir, workload, steps, device, tmp):
    path = os.path.join(tmp, "data.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in data(workload))
    out = os.path.join(tmp, "grpo")
    grpo.main(["--algo", "drgrpo", "--model", model_dir, "--dataset", path, "--reward-fn",
               f"{os.path.abspath(__file__)}:{workload}", "--prompts-per-step", str(B), "--num-generations", str(G),
               "--max-new-tokens", str(T), "--lora-r", str(LORA_R), "--learning-rate", str(LR), "--micro-batch-size",
               str(B * G), "--max-steps", str(steps + 1), "--eval-every", "0", "--save-every", "0", "--system-prompt",
               SYSTEM, "--output-dir", out, "--dtype", DTYPE, "--beta", "0", "--compile-generate", COMPILE]
              + (["--gradient-checkpointing"] if GC else []))
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))][1:]
    # whole step; the sampler's seconds per decode step (generate runs until the longest completion ends); and
    # on CUDA each phase's peak memory in MiB (torch's allocator: sampling and rewards, then the training step)
    return [(r["completion/tokens"] / r["tokens_per_second"], r["completion/tokens"],
             r["time/generate"] / r["groups/gen_rounds"] / r["completion/max_length"],
             1024 * r.get("memory/generate_gib", math.nan), 1024 * r.get("memory/train_gib", math.nan)) for r in rows]


def child_trl(model_dir, workload, steps, device, tmp, fastest=False):
    import datasets
    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    system = [{"role": "system", "content": SYSTEM}] if SYSTEM else []
    rows = [{"prompt": system + [{"role": "user", "content": d["prompt"]}], "answer": d["answer"]}
            for d in data(workload)]
    reward = graded if workload == "graded" else binary

    def reward_fn(completions, answer, **kw):
        return [reward(c[0]["content"], a) for c, a in zip(completions, answer)]
    times, tokens = [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                tokens.append(logs["completions/mean_length"] * B * G)
    dtype = torch.bfloat16 if DTYPE == "bf16" else torch.float32
    cfg = GRPOConfig(output_dir=os.path.join(tmp, "trl"), per_device_train_batch_size=B * G, num_generations=G,
                     max_completion_length=T, learning_rate=LR, beta=0.0, loss_type="dr_grpo", scale_rewards="none",
                     temperature=1.0, top_p=1.0, max_steps=steps + 1, logging_steps=1, save_strategy="no",
                     report_to="none", use_cpu=device == "cpu", bf16=DTYPE == "bf16", seed=0, disable_dropout=True,
                     gradient_checkpointing=GC,
                     **({"use_transformers_continuous_batching": True} if fastest else {}))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=cfg, train_dataset=datasets.Dataset.from_list(rows),
                          processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[Clock()],
                          peft_config=peft.LoraConfig(r=LORA_R, lora_alpha=32, target_modules="all-linear",
                                                      task_type="CAUSAL_LM"))
    trainer.train()
    return list(zip(times, tokens))[1:]


def child_floor(model_dir, workload, steps, device, tmp):
    """One batched generate + one forward/backward of the same completions: no reward, no advantage."""
    a = grpo.parse_args(["--model", model_dir, "--lora-r", str(LORA_R), "--max-new-tokens", str(T), "--system-prompt",
                         SYSTEM, "--dtype", DTYPE])
    model, tok, _ = grpo.load_model(a, torch.device(device))
    opt = grpo.make_optimizer(a, model)
    out = []
    for step in range(steps + 1):
        t0 = time.perf_counter()
        rows = [{"record": d} for d in data(workload)[step * B:(step + 1) * B] for _ in range(G)]
        grpo.generate(model, tok, rows, a)  # (each prompt rendered with --system-prompt SYSTEM)
        for i, r in enumerate(rows):
            r.update(order=i // G, is_teacher=False, reward=0.0, rewards={})
        b = grpo.collate(rows, tok.pad_token_id, device)
        logp, _ = grpo.token_logps(model, b["input_ids"], b["attention_mask"], b["mask"].shape[1])
        (-(logp * b["mask"]).sum() / (B * G * T)).backward()
        opt.step()
        opt.zero_grad()
        if device == "cuda":
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t0, sum(len(r["completion"]) for r in rows)))
    return out[1:]


CHILDREN = {"grpo.py": child_grpo, "TRL GRPOTrainer": child_trl, "floor": child_floor,
            "TRL continuous batching": lambda *args: child_trl(*args, fastest=True)}  # GPU only


def bandwidth_limit_ms(model_dir, rows, new_tokens, tb_per_s):
    """One decode step can be no faster than reading every bf16 weight once, plus the KV cache at its mean length."""
    from transformers import AutoConfig
    c = AutoConfig.from_pretrained(model_dir)
    head = c.hidden_size // c.num_attention_heads
    weights = 2 * (c.vocab_size * c.hidden_size + c.num_hidden_layers * (
        c.hidden_size * head * (c.num_attention_heads * 2 + c.num_key_value_heads * 2) + 3 * c.hidden_size
        * c.intermediate_size))
    kv = 2 * rows * c.num_hidden_layers * 2 * c.num_key_value_heads * head * (200 + new_tokens / 2)  # prompts ~200
    return 1000 * (weights + kv) / (tb_per_s * 1e12)


def run_child(cmd):
    """A contender's process, which never outlives this one: the kernel kills it if this process dies (even by
    SIGKILL), and it and all it started (compile workers) are killed as it ends, or as this process is stopped."""
    def die_with_parent():
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         preexec_fn=die_with_parent)
    try:
        err = p.communicate()[1]
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return p.returncode, err


def peak_memory_mb(device):
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ----------------------------------------------------------------------------- parent
def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--workloads", default="graded,binary")
    p.add_argument("--no-gc", action="store_true", help="no gradient checkpointing in either trainer")
    p.add_argument("--real-width", action="store_true", help="Qwen2.5-0.5B's widths, 2 x 8 a step, GSM8K-length "
                   "prompts with the default system prompt (always on with --device cuda)")
    p.add_argument("--layers", type=int, default=0, help="layers of the real-width model (default 2 on CPU, 24 on GPU)")
    p.add_argument("--dtype", default="", help="fp32 | bf16 (default fp32 on CPU, bf16 on GPU)")
    p.add_argument("--shapes", default="", help="BxGxT,... (default 8x8x256,2x8x64 on GPU; one shape on CPU)")
    p.add_argument("--compile-generate", default="auto", help="grpo.py's flag")
    p.add_argument("--contenders", default="", help="a comma list of the contenders to run (default all)")
    p.add_argument("--bandwidth", type=float, default=3.35, help="GPU memory bandwidth, TB/s (H100 SXM: 3.35)")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)  # NAME WORKLOAD MODEL_DIR RESULT.json
    args = p.parse_args()
    for sig in (signal.SIGTERM, signal.SIGHUP):  # a stop runs run_child's clean-up, as Ctrl-C does
        signal.signal(sig, lambda s, f: sys.exit(128 + s))
    global GC, B, G, T, SYSTEM, DTYPE, PROMPTS, COMPILE
    GC, COMPILE = not args.no_gc, args.compile_generate
    DTYPE = args.dtype or ("fp32" if args.device == "cpu" else "bf16")
    real_width = args.real_width or args.device == "cuda"
    if real_width:
        B, SYSTEM, PROMPTS = 2, grpo.Args.system_prompt, GSM8K_LENGTH
    shapes = args.shapes or ("8x8x256,2x8x64" if args.device == "cuda" else f"{B}x{G}x{T}")
    if args.child:
        B, G, T = map(int, shapes.split(",")[0].split("x"))
        name, workload, model_dir, result = args.child
        torch.manual_seed(0)
        with tempfile.TemporaryDirectory() as tmp:
            steps = CHILDREN[name](model_dir, workload, args.steps, args.device, tmp)
        json.dump({"steps": steps, "peak_mb": peak_memory_mb(args.device)}, open(result, "w"))
        return
    tmp = tempfile.mkdtemp()
    model_dir = build(os.path.join(tmp, "model"), real_width, args.layers or (24 if args.device == "cuda" else 2))
    lines, children = [], [n for n in CHILDREN if (args.device == "cuda" or n != "TRL continuous batching")
                           and (not args.contenders or n in args.contenders.split(","))]
    for shape, workload in [(sh, w) for sh in shapes.split(",") for w in args.workloads.split(",")]:
        B, G, T = map(int, shape.split("x"))
        limit = bandwidth_limit_ms(model_dir, B * G, T, args.bandwidth)
        per_1k, rep_medians = {n: [] for n in children}, {n: [] for n in children}
        peak, decode, phases = {n: 0.0 for n in children}, [], []
        for rep in range(args.reps):
            for name in children:  # interleaved: A B C A B C ...
                result = os.path.join(tmp, "result.json")
                code, err = run_child([sys.executable, os.path.abspath(__file__)] + sys.argv[1:]
                                       + ["--shapes", shape, "--child", name, workload, model_dir, result])
                if code:  # e.g. a TRL without continuous batching: that row says so, the others go on
                    print(f"  {name} failed: {err.strip().splitlines()[-1:]}", file=sys.stderr)
                    continue
                r = json.load(open(result))
                per_1k[name] += [1000 * s[0] / s[1] for s in r["steps"]]
                rep_medians[name].append(statistics.median(1000 * s[0] / s[1] for s in r["steps"]))
                peak[name] = max(peak[name], r["peak_mb"])
                decode += [1000 * s[2] for s in r["steps"] if len(s) > 2]
                phases += [s[3:] for s in r["steps"] if len(s) > 3]
                print(f"  {workload} rep {rep + 1}: {name} {statistics.median(per_1k[name]):.3f} s/1k tokens",
                      file=sys.stderr, flush=True)
        med = {n: statistics.median(v) if v else math.nan for n, v in per_1k.items()}
        lines.append(f"\nworkload {workload}: {B} prompts x {G} completions, <= {T} new tokens, LoRA r{LORA_R}, "
                     f"{args.device}, {DTYPE}, {'real width, ' if real_width else ''}"
                     f"gradient checkpointing {'on' if GC else 'off'}, "
                     f"{args.reps} reps x {args.steps} steps")
        lines.append("| contender | s per 1k completion tokens (median) | reps' medians | vs TRL | vs floor "
                     "| peak memory (MiB) |")
        lines.append("| --- | --- | --- | --- | --- | --- |")
        for n in children:
            spread = f"{min(rep_medians[n]):.2f}-{max(rep_medians[n]):.2f}" if rep_medians[n] else "failed"
            lines.append(f"| {n} | {med[n]:.3f} | {spread} | {med[n] / med.get('TRL GRPOTrainer', math.nan):.2f}x "
                         f"| {med[n] / med.get('floor', math.nan):.2f}x | {peak[n]:.0f} |")
        if decode and args.device == "cuda":
            lines.append(f"grpo.py's sampler: {statistics.median(decode):.2f} ms per decode step (median); the "
                         f"bandwidth limit is {limit:.2f} ms (weights + KV cache read once at {args.bandwidth} TB/s); "
                         f"peak memory by phase: sampling {max(p[0] for p in phases):.0f} MiB, training "
                         f"{max(p[1] for p in phases):.0f} MiB")
        print("\n".join(lines[-(len(children) + 3 + (decode != [] and args.device == "cuda")):]), flush=True)
    versions = {m: importlib.util.find_spec(m) and __import__(m).__version__ or "not installed"
                for m in ("torch", "transformers", "peft", "trl")}
    print("\nversions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))


if __name__ == "__main__":
    main()
