"""The GPU check, in one command: every preset, the mixed pool, QLoRA, full fine-tuning, a one-process
torchrun (nccl), the 2025-26 variants and tool calls, a few steps each in bf16 on a random model of Qwen2.5-0.5B's shape
(24 layers, vocab 151,936), with the compiled sampler (QLoRA samples uncompiled: bitsandbytes' layers do not
compile), then bench/speed.py --device cuda against TRL. Prints one table; the sampler's log-prob gap to the
trainer and each phase's peak memory (torch's allocator: memory/generate_gib, memory/train_gib) are columns.

    pip install -r requirements.txt -r bench/requirements.txt
    python bench/gpu_check.py                 # about 10 minutes on one H100
    python bench/gpu_check.py --no-speed      # the runs only
"""
import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import tiny  # noqa: E402

STEPS = ["--max-steps", "3", "--prompts-per-step", "4", "--num-generations", "8", "--max-new-tokens", "128",
         "--eval-every", "3", "--eval-prompts", "16", "--save-every", "0", "--dtype", "auto",
         "--compile-generate", "on"]


def digits(completion, answer, **kw):  # a random model rarely answers right: a dense reward keeps groups informative
    return sum(c.isdigit() for c in completion[:64]) / 64


FORCED_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17*23"}}\n</tool_call>'


def force_calls(grpo):
    """The tools row: every other row's first turn is a calculator call (its log-probs NaN: not the sampler's), so
    the compiled sampler draws on after a tool's result, and its log-probs there meet the trainer's (logp gap)."""
    import torch
    real = grpo.sample

    def sample(model, tok, held, new_tokens, a, greedy=False, sampler=None, temps=None):
        drawn, logp = real(model, tok, held, new_tokens, a, greedy, sampler, temps)
        call = torch.tensor(tok(FORCED_CALL, add_special_tokens=False).input_ids + [tok.eos_token_id])
        for r, h in enumerate(held):
            if r % 2 == 0 and "<tool_response>" not in tok.decode(h) and drawn.shape[1] >= len(call):
                drawn[r, :len(call)] = call
                logp[r, :len(call)] = float("nan")
        return drawn, logp
    grpo.sample = sample


if os.environ.get("GPU_CHECK_FORCED_CALLS") and hasattr(sys.modules["__main__"], "sample"):  # loaded by grpo.py
    force_calls(sys.modules["__main__"])


def runs(tmp):
    data = [{"prompt": f"What is {i} + {2 * i}?", "answer": str(3 * i)} for i in range(16)]
    with open(os.path.join(tmp, "data.jsonl"), "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in data)
    with open(os.path.join(tmp, "pool.jsonl"), "w") as f:
        f.writelines(json.dumps({"prompt": d["prompt"], "completion": c, "reward": r}) + "\n" for d in data
                     for c, r in ((f"\\boxed{{{d['answer']}}}", 1.0), ("\\boxed{0}", 0.0)))
    mixed = ["--dataset", f"{tmp}/data.jsonl", "--teacher-pool", f"{tmp}/pool.jsonl", "--teacher-per-group", "2",
             "--split-grads", "--eval-dataset", f"{tmp}/data.jsonl"]  # (STEPS' evaluation flags need a set)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    yield "grpo", [], []
    yield "drgrpo", [], []
    yield "dapo", [], []
    yield "drgrpo_soft", [], []
    yield "drgrpo mixed pool --split-grads", mixed, []
    yield "grpo --load-in-4bit (QLoRA)", ["--load-in-4bit"], []
    yield "grpo full fine-tuning, --num-iterations 2", ["--lora-r", "0", "--num-iterations", "2",
                                                        "--gradient-checkpointing"], []
    yield "dapo torchrun 1 process (nccl)", [], torchrun
    variants = ["--surrogate", "kl_cov", "--kl-in-reward", "0.01", "--top-entropy-quantile", "0.5",
                "--entropy-coef", "0.01", "--tis", "2", "--tis-mode", "sequence_mask", "--tis-min", "0.5",
                "--opsm-delta", "0.5", "--num-iterations", "2"]
    yield "grpo 2025-26 variants together", variants, []
    yield "drgrpo gmpo, rloo", ["--surrogate", "gmpo", "--adv-estimator", "rloo", "--num-iterations", "2"], []
    yield "grpo --tools calculator (calls forced)", ["--tools", "calculator", "--max-new-tokens", "256"], []


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--no-speed", action="store_true")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time on the one GPU (the times then overlap)")
    args = p.parse_args()
    tmp = tempfile.mkdtemp()
    model = tiny.make_tiny(os.path.join(tmp, "model"), layers=24, chat_template=tiny.TOOLS_CHAT_TEMPLATE,
                           **tiny.QWEN25_05B)  # (renders the runs' prompts as the plain template: a system message)

    def one(run):
        name, extra, launcher = run
        algo = name.split()[0]
        out = os.path.join(tmp, name.replace(" ", "_").replace("/", "_"))
        cmd = (launcher or [sys.executable]) + [os.path.join(ROOT, "grpo.py"), "--algo", algo, "--model", model,
                                                "--output-dir", out, "--reward-fn", f"{__file__}:digits",
                                                "--rewards", "correct"] + STEPS + extra
        t0 = time.time()
        env = {**os.environ, "GPU_CHECK_FORCED_CALLS": "1" if "--tools" in extra else ""}
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        wall = time.time() - t0
        if p.returncode:
            row = f"| {name} | FAILED: {(p.stderr.strip().splitlines() or ['?'])[-1][:120]} | | | | | | | |"
            print(row, p.stderr[-3000:], sep="\n", flush=True)
            return row
        m = [r for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if r["step"]]  # step 0: eval only
        calls = f" ({m[-1]['tools/calls']:g} calls a completion)" if "tools/calls" in m[-1] else ""
        row = (f"| {name} | ok{calls} | {wall:.0f} | {sum(r['time/generate'] for r in m) / len(m):.2f} | "
               f"{sum(r['time/train'] for r in m) / len(m):.2f} | {m[-1].get('grad/norm', 0):.3g} | "
               f"{max(r.get('sampler/logp_gap', 0) for r in m):.3g} | "
               + " | ".join(f"{max(r.get(f'memory/{k}_gib', 0) for r in m):.2f}" for k in ("generate", "train")) + " |")
        print(row, flush=True)
        return row
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(one, runs(tmp)))
    print("\n| run | result | wall s (3 steps, load included) | generate s/step | train s/step | last grad norm "
          "| max sampler/logp_gap | peak GiB sampling | peak GiB training |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    if not args.no_speed:
        subprocess.run([sys.executable, os.path.join(ROOT, "bench", "speed.py"), "--device", "cuda", "--reps", "2",
                        "--steps", "3"], check=False)


if __name__ == "__main__":
    main()
