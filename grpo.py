"""grpo.py: GRPO and its descendants in one file, for fine-tuning language models on verifiable rewards.

    python grpo.py --algo grpo        --model Qwen/Qwen2.5-0.5B-Instruct
    python grpo.py --algo drgrpo      --model Qwen/Qwen2.5-0.5B-Instruct
    python grpo.py --algo dapo        --model Qwen/Qwen2.5-0.5B-Instruct
    python grpo.py --algo drgrpo_soft --model Qwen/Qwen2.5-0.5B-Instruct
    python grpo.py --algo drgrpo --dry-run      # print the objective a preset optimises, then exit
    torchrun --nproc_per_node 4 grpo.py ...     # several GPUs: each rank takes whole groups
    python grpo.py --resume --max-steps 400     # continue the run saved in --output-dir, bit for bit

One step: B prompts -> G sampled completions each -> rewards -> group-relative
advantages -> clipped token loss -> one optimizer step (num_iterations of them).

Papers (a preset is only a set of defaults; every knob is its own flag):
  grpo         GRPO, DeepSeekMath (2402.03300) §4.1: A = (R - mean) / std over the group,
               each sequence's loss averaged over its tokens, then over sequences; k3 KL, beta 0.04.
  drgrpo       Dr. GRPO (2503.20783) §3.1: no / std (difficulty bias) and no 1/|o_i| (length
               bias): token sums divided by a constant, n_seq * max_new_tokens. No KL.
  dapo         DAPO (2503.14476) §3: clip-higher (eps_high 0.28), dynamic sampling (drop
               groups whose rewards are all equal, refill), token-mean loss over the whole
               batch, soft overlong punishment, +1/-1 correctness reward. No KL.
  drgrpo_soft  Dr. GRPO+ soft reweighting: Dr. GRPO advantages scaled per group by
               w = std_g / max_g' std_g', token sums averaged over sequences (no / T).
Newer losses, each a flag at the one loss site (policy_loss): --ratio sequence (GSPO, 2507.18071),
--surrogate cispo (MiniMax-M1, 2506.13585) | sapo (2511.20347), --dual-clip (1912.09729); KL: --kl.
Sampling: a static KV cache and a decode step compiled once per run (--compile-generate, on with CUDA); the
sampler's own log-probs are logged against the trainer's (sampler/logp_gap) and can weight the loss (--tis).
Mixed pool (--teacher-pool): each group is G_s live student samples plus G_t cached teacher
completions with frozen rewards; --split-grads backpropagates the two halves apart.

Departures, on purpose: one rollout per optimizer step by default (num_iterations = 1, so the
ratio is 1 and old_logp = logp.detach()); std is torch's unbiased std (as TRL and verl);
logits are divided by the sampling temperature in every log-prob (as TRL and verl); groups with
all-equal rewards skip their forward/backward only when beta = 0 (then exactly); under torchrun the
loss normalisers are global and each rank's accumulated gradient is all-reduced as a sum once per
step (the DDP wrapper would average inside every backward, and ranks here may run different
numbers of micro-batches).

Shapes: B prompts per step, G completions per prompt (G = G_s + G_t in the mixed pool),
N = B*G rows, P prompt length (left padded), C completion length (<= T = max_new_tokens),
V vocabulary.
"""
import argparse
import contextlib
import copy
import dataclasses
import hashlib
import importlib.util
import inspect
import itertools
import json
import math
import os
import random
import runpy
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import rewards as R


def dash(name: str) -> str:
    """A field's flag as typed: max_new_tokens -> --max-new-tokens."""
    return "--" + name.replace("_", "-")


def fail(msg: str):
    """Bad input or impossible flags: one line, before any training when it can be found then."""
    raise SystemExit(f"grpo: error: {msg}")


# ----------------------------------------------------------------------------- flags
def flag(default, help, choices=(), within=""):
    """A field of Args: its default, its help, and the values it allows: one of choices, or in the interval
    within, e.g. "(0, 1]" (a float flag is always finite)."""
    return field(default=default, metadata={"help": help, "choices": choices, "within": within})


GE0, GE1, GT0 = "[0, inf)", "[1, inf)", "(0, inf)"


LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
PRESETS = {  # SPEC §5; values from the papers and seeds
    "grpo": dict(scale="std", loss_agg="seq-mean-token-mean", eps_low=0.2, eps_high=0.2, beta=0.04),
    "drgrpo": dict(scale="none", loss_agg="seq-mean-token-sum-norm", eps_low=0.2, eps_high=0.2, beta=0.0),
    "dapo": dict(scale="std", loss_agg="token-mean", eps_low=0.2, eps_high=0.28, beta=0.0,
                 dynamic_sampling=True, overlong_penalty=True, rewards="correct_pm1"),
    "drgrpo_soft": dict(scale="none", loss_agg="seq-mean-token-sum", eps_low=0.2, eps_high=0.2, beta=0.0,
                        soft_reweight=True),
}


@dataclass
class Args:
    # run
    algo: str = flag("grpo", "preset: sets defaults (PRESETS); explicit flags win", tuple(PRESETS))
    model: str = flag("Qwen/Qwen2.5-0.5B-Instruct", "hub id or local directory")
    output_dir: str = flag("grpo_out", "checkpoint/ (weights, optimizer, RNG, flags) and metrics.jsonl go here")
    resume: bool = flag(False, "continue the run saved in --output-dir (its flags; only run-length flags may change)")
    overwrite: bool = flag(False, "start over in an --output-dir that holds a previous run, deleting it")
    max_steps: int = flag(200, "optimizer steps (x num_iterations)", within=GE1)
    seed: int = flag(0, "seeds data order, sampling (+1000*rank) and LoRA init")
    dry_run: bool = flag(False, "print the resolved flags and the objective they optimise, then exit")
    save_every: int = flag(50, "steps between checkpoints (0: only at the end)", within=GE0)
    wandb_project: str = flag("", "log to this wandb project too (needs wandb installed)")
    log_samples: int = flag(0, "groups a step written to samples.jsonl: texts, each reward, advantage", within=GE0)
    # data
    dataset: str = flag("", "'' built-in arithmetic | gsm8k (needs `datasets`) | JSONL: question/answer, prompt/answer")
    eval_dataset: str = flag("", "JSONL of held-out prompts (gsm8k and the built-in task have their own)")
    eval_every: int = flag(50, "steps between evaluations, also before the first and the last (0: never)", within=GE0)
    eval_samples: int = flag(0, "k: sample k completions per held-out prompt too, for mean@k and pass@k", within=GE0)
    eval_prompts: int = flag(64, "held-out prompts per evaluation", within=GE1)
    system_prompt: str = flag("Please reason step by step, and put your final answer within \\boxed{}.",
                              "system message of the chat template ('' for none)")
    # generate
    prompts_per_step: int = flag(8, "B: prompts (groups) per optimizer step, over all ranks", within=GE1)
    num_generations: int = flag(8, "G_s: sampled completions per prompt", within=GE1)
    max_new_tokens: int = flag(256, "T: completion length cap (also Dr. GRPO's constant normaliser)", within=GE1)
    temperature: float = flag(1.0, "sampling temperature", within=GT0)
    top_p: float = flag(1.0, "nucleus sampling (1: off)", within="(0, 1]")
    top_k: int = flag(0, "top-k sampling (0: off)", within=GE0)
    compile_generate: str = flag("auto", "static KV cache and a compiled decode step (auto: with CUDA)",
                                 ("auto", "on", "off"))
    # reward
    rewards: str = flag("correct", "weighted built-in rewards, e.g. correct:1,format:0.2 (rewards.REWARDS)")
    reward_fn: str = flag("", "your own reward, PATH.py:FUNCTION; used alone unless --rewards is also given")
    overlong_penalty: bool = flag(False, "DAPO §3.4 soft overlong punishment added to the reward")
    overlong_buffer: int = flag(0, "L_cache in tokens for the overlong penalty (0: T // 5)", within=GE0)
    # advantage and group filters
    scale: str = flag("std", "std: A = (R - mean) / (std + eps) | none: A = R - mean (Dr. GRPO)", ("std", "none"))
    std_eps: float = flag(1e-6, "eps in the std scaling and in the soft weights", within=GT0)
    soft_reweight: bool = flag(False, "Dr. GRPO+ soft: A *= std_g / max std over the step's groups")
    dynamic_sampling: bool = flag(False, "DAPO §3.2: keep groups whose rewards differ, regenerate to refill B")
    max_gen_rounds: int = flag(4, "cap on generation rounds per step for dynamic sampling", within=GE1)
    top_k_groups: int = flag(0, "keep the k groups with the largest reward std (0: off)", within=GE0)
    skip_zero_variance: bool = flag(True, "skip forward/backward of groups with equal rewards (exact with beta 0)")
    # loss
    loss_agg: str = flag("seq-mean-token-mean", "how token losses become one number (see aggregate_loss)", LOSS_AGGS)
    eps_low: float = flag(0.2, "ratio clipped below at 1 - eps_low", within="[0, 1)")
    eps_high: float = flag(0.2, "ratio clipped above at 1 + eps_high (DAPO clip-higher: 0.28)", within=GE0)
    ratio: str = flag("token", "token: r = pi / pi_old per token | sequence: GSPO's s_i = exp(mean_t log r)",
                      ("token", "sequence"))
    surrogate: str = flag("clip", "clip: PPO's -min(rA, clip(r) A) | cispo: -sg(clip(r)) A log pi | sapo: soft gate",
                          ("clip", "cispo", "sapo"))
    sapo_tau_pos: float = flag(1.0, "SAPO gate temperature where A > 0", within=GT0)
    sapo_tau_neg: float = flag(1.05, "SAPO gate temperature where A < 0", within=GT0)
    dual_clip: float = flag(0.0, "c > 1: where A < 0 the loss is at most c |A| (dual-clip PPO; 0: off)", within=GE0)
    beta: float = flag(0.0, "KL weight against the reference (adapter disabled)", within=GE0)
    kl: str = flag("k3", "KL term (see kl_penalty)", ("k3", "k3_ratio", "k2"))
    mask_truncated: bool = flag(False, "DAPO §3.4 overlong filtering: no loss on completions without EOS")
    tis: float = flag(0.0, "C: weight token losses by min(pi_old / pi_sampler, C), truncated IS (0: off)", within=GE0)
    num_iterations: int = flag(1, "optimizer steps per rollout batch (old_logp computed once if > 1)", within=GE1)
    # mixed student + teacher pool
    teacher_pool: str = flag("", "JSONL of cached teacher completions: prompt, completion, reward")
    teacher_per_group: int = flag(0, "G_t: teacher completions per group, beside the G_s student samples", within=GE0)
    split_grads: bool = flag(False, "backpropagate student and teacher halves apart; log |g_s|, |g_t|, cos")
    # model and optimizer
    lora_r: int = flag(16, "LoRA rank (0: full fine-tuning)", within=GE0)
    lora_alpha: int = flag(32, "LoRA alpha", within=GT0)
    lora_dropout: float = flag(0.0, "LoRA dropout (0 keeps logp deterministic between passes)", within="[0, 1)")
    load_in_4bit: bool = flag(False, "QLoRA: 4-bit NF4 base weights (bitsandbytes)")
    dtype: str = flag("auto", "auto: bf16 where supported, else fp32", ("auto", "bf16", "fp32"))
    gradient_checkpointing: bool = flag(False, "recompute activations in backward")
    micro_batch_size: int = flag(8, "rows per training forward/backward (gradient accumulation)", within=GE1)
    optim: str = flag("adamw_torch", "AdamW: torch's, or bitsandbytes' 8-bit or paged 8-bit",
                      ("adamw_torch", "adamw_8bit", "paged_adamw_8bit"))
    learning_rate: float = flag(2e-5, "AdamW learning rate", within=GT0)
    warmup_steps: int = flag(0, "linear warm-up of the learning rate over N steps (DAPO: 20)", within=GE0)
    weight_decay: float = flag(0.0, "AdamW weight decay", within=GE0)
    max_grad_norm: float = flag(1.0, "clip the gradient norm (0: no clipping)", within=GE0)


STAGES = {"algo": "run", "dataset": "data", "prompts_per_step": "generate", "rewards": "reward",
          "scale": "advantage and group filters", "loss_agg": "loss",
          "teacher_pool": "mixed student + teacher pool", "lora_r": "model and optimizer"}

RUN_LENGTH = {"output_dir", "resume", "overwrite", "dry_run", "max_steps", "save_every", "eval_every", "eval_prompts",
              "eval_samples", "log_samples", "wandb_project", "compile_generate"}  # what --resume lets change


def parse_args(argv=None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], argument_default=argparse.SUPPRESS)
    group = parser
    for f in dataclasses.fields(Args):
        if f.name in STAGES:
            group = parser.add_argument_group(STAGES[f.name])
        kind = dict(action=argparse.BooleanOptionalAction) if f.type in (bool, "bool") else dict(type=type(f.default))
        by_algo = {algo: preset.get(f.name, f.default) for algo, preset in PRESETS.items()}
        default = ", ".join(f"{k} {v!r}" for k, v in by_algo.items()) if len(set(by_algo.values())) > 1 \
            else repr(f.default)
        group.add_argument(dash(f.name), help=f"{f.metadata['help']} [{default}]", choices=f.metadata["choices"] or None,
                           **kind)
    given = vars(parser.parse_args(argv))
    defaults = PRESETS[given.get("algo", Args.algo)]  # a preset is defaults; an explicit flag wins
    if given.get("resume"):  # the saved run's flags are the defaults; only run-length flags may differ
        d = given.get("output_dir", Args.output_dir)
        ckpt, problems = find_checkpoint(d)
        if not ckpt:
            fail(f"--resume: no checkpoint to continue in {d!r}: " + ("; ".join(problems) + " (--overwrite starts over)"
                 if problems else "a run that stopped before its first save leaves none; start it without --resume"))
        if problems:
            print(f"grpo: warning: {problems[0]}; continuing from {ckpt}", file=sys.stderr)
        with open(os.path.join(ckpt, "grpo_args.json")) as f:
            defaults = {k: v for k, v in json.load(f).items() if k in Args.__dataclass_fields__}
        for k, v in given.items():
            if k not in RUN_LENGTH and defaults[k] != v:
                fail(f"--resume: {dash(k)} is {v!r} here but {defaults[k]!r} in the saved run: drop "
                     f"the flag to continue that run, or start a new one in another --output-dir")
    elif given.get("reward_fn") and "rewards" not in given:
        defaults = {**defaults, "rewards": ""}  # a custom reward alone, unless --rewards names built-ins too
    args = Args(**{**defaults, **given})
    # derived values
    if args.overlong_penalty and args.overlong_buffer == 0:
        args.overlong_buffer = max(1, args.max_new_tokens // 5)
    check_args(args)
    return args


def check_args(a: Args):
    """Impossible flags and combinations fail here, the first one found, with what to change."""
    for f in dataclasses.fields(a):  # argparse checked the choices; here each flag's interval
        v, within = getattr(a, f.name), f.metadata["within"]
        if isinstance(v, float) and not math.isfinite(v):
            fail(f"{dash(f.name)} must be a finite number, not {v}")
        lo, hi = map(float, within[1:-1].split(",")) if within else (0, 0)
        if within and not ((lo < v if within[:1] == "(" else lo <= v) and (v < hi if within[-1:] == ")" else v <= hi)):
            fail(f"{dash(f.name)} must be " + (f"in {within}" if hi < math.inf else f"at least {lo:g}"
                                               if within[0] == "[" else f"> {lo:g}"))
    for bad, msg in [
            (a.dual_clip and (a.dual_clip <= 1 or a.surrogate != "clip"),
             "--dual-clip c caps the clipped surrogate's loss at c |A|: it needs c > 1 and --surrogate clip"),
            (a.num_generations + a.teacher_per_group < 2,
             "a group needs at least 2 completions for a group-relative advantage: raise --num-generations"),
            (a.resume and a.overwrite, "--resume continues the run in --output-dir, --overwrite deletes it: give one"),
            (a.load_in_4bit and a.lora_r == 0,
             "--load-in-4bit trains LoRA adapters on frozen 4-bit weights: set --lora-r > 0"),
            (a.overlong_penalty and not 0 < a.overlong_buffer <= a.max_new_tokens,
             "--overlong-buffer must be in (0, --max-new-tokens]"),
            (a.top_k_groups > a.prompts_per_step, "--top-k-groups must be at most --prompts-per-step"),
            (bool(a.teacher_pool) != (a.teacher_per_group > 0),
             "the mixed pool needs both --teacher-pool PATH and --teacher-per-group G_T > 0"),
            (a.split_grads and not a.teacher_pool,
             "--split-grads splits student and teacher gradients: it needs --teacher-pool"),
            (not a.rewards and not a.reward_fn, "no reward: give --rewards and/or --reward-fn")]:
        if bad:
            fail(msg)


def describe_objective(a: Args) -> str:
    """The objective the resolved flags optimise, in one formula, for --dry-run."""
    clip = f"clip(r, 1-{a.eps_low:g}, 1+{a.eps_high:g})"
    term = {"clip": f"min(r·A_i, {clip}·A_i)", "cispo": f"sg({clip})·A_i·log π_θ",
            "sapo": f"4/τ·σ(τ(r-1))·A_i, τ = {a.sapo_tau_pos:g} if A_i > 0 else {a.sapo_tau_neg:g}"}[a.surrogate]
    term = f"max({term}, {a.dual_clip:g}·A_i if A_i < 0)" if a.dual_clip else term
    term = f"min(π_old/π_sampler, {a.tis:g})·{term}" if a.tis else term
    term += f" - {a.beta:g}·KL_{a.kl}" if a.beta else ""
    n = {"token-mean": "Σ_i |o_i|", "seq-mean-token-mean": "n_seq |o_i|", "seq-mean-token-sum": "n_seq",
         "seq-mean-token-sum-norm": f"n_seq·{a.max_new_tokens}"}[a.loss_agg]
    r = "s_i = exp(mean_t log π_θ/π_old)" if a.ratio == "sequence" else "π_θ/π_old per token"
    adv = "(R_i - mean_g(R)) / (std_g(R) + eps)" if a.scale == "std" else "R_i - mean_g(R)"
    reward = [a.rewards.replace(",", " + "), a.reward_fn, a.overlong_penalty and f"overlong(L_cache={a.overlong_buffer})"]
    filters = [a.dynamic_sampling and f"dynamic sampling (≤{a.max_gen_rounds} rounds)", a.top_k_groups and
               f"top-{a.top_k_groups} groups by std", a.mask_truncated and "truncated completions masked"]
    return "\n".join([f"J(θ) = E_q [ Σ_i Σ_t ({term}) / ({n}) ],  r = {r}",
                      f"  A_i = {adv}" + ("  ·  std_g / max_g' std_g'" if a.soft_reweight else ""),
                      f"  R = {' + '.join(filter(None, reward))}",
                      f"  filters: {', '.join(filter(None, filters)) or 'none'}"])


# ----------------------------------------------------------------------------- distributed
def setup_distributed():
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; a plain `python grpo.py` is world 1, no process group."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    local = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def all_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place (identity in one process)."""
    if dist.is_initialized():
        dist.all_reduce(x)
    return x


def all_gather(obj) -> list:
    """One entry per rank, in rank order ([obj] in one process)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ----------------------------------------------------------------------------- data
def arithmetic_task(n: int, seed: int) -> list[dict]:
    """The built-in verifiable task: seeded one-step arithmetic word problems, made on the fly."""
    rng = random.Random(seed)
    names, items = ["Ava", "Ben", "Chen", "Dana", "Eli", "Fatima", "Gus", "Hana"], ["apples", "pens", "coins", "cards"]
    out = []
    for _ in range(n):
        who, what, a, b = rng.choice(names), rng.choice(items), rng.randint(2, 99), rng.randint(2, 99)
        kind = rng.randrange(4)
        if kind >= 2:
            a = rng.randint(2, 12)
        q, ans = [(f"{who} has {a} {what} and gets {b} more. How many {what} does {who} have now?", a + b),
                  (f"{who} has {max(a, b)} {what} and gives away {min(a, b)}. How many {what} are left?", abs(a - b)),
                  (f"{who} buys {a} boxes with {b} {what} in each. How many {what} is that?", a * b),
                  (f"{who} shares {a * b} {what} equally among {a} friends. How many does each get?", b)][kind]
        out.append({"prompt": q, "answer": str(ans)})
    return out


TEXT = (lambda v: isinstance(v, str) and v.strip() != "", "a non-empty string")  # a field's check, and its name
NUMBER = (lambda v: type(v) in (int, float) and math.isfinite(v), "a finite number")
ANSWER = (lambda v: v is None or type(v) in (str, int, float), "a string or a number")


def read_jsonl(path: str, *schemas: dict) -> list[tuple[int, dict]]:
    """(line number, record) for each non-empty line of a JSONL file, the one reader of every data file: each
    line a JSON object with the fields of a schema (the first whose first field the first line has), each field
    passing its check. An error names the file, the line and the field."""
    if not os.path.isfile(path):
        fail(f"{path}: " + ("is a directory" if os.path.isdir(path) else "no such file"))
    rows, schema = [], None
    with open(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            try:
                rec = json.loads(raw.decode("utf-8")) if raw.strip() else None
            except UnicodeDecodeError:
                fail(f"{path}:{i}: not UTF-8 text")
            except json.JSONDecodeError as e:
                fail(f"{path}:{i}: not valid JSON ({e.msg}); JSONL is one JSON object per line")
            if rec is None:
                continue
            schema = schema or next((s for s in schemas if isinstance(rec, dict) and next(iter(s)) in rec), schemas[-1])
            if not isinstance(rec, dict) or any(k not in rec for k in schema):
                fail(f"{path}:{i}: each line needs the fields {', '.join(schema)} (one JSON object a line)")
            for k, (ok, what) in schema.items():
                if not ok(rec[k]):
                    fail(f"{path}:{i}: {k} must be {what}, not {rec[k]!r:.60}")
            rows.append((i, rec))
    if not rows:
        fail(f"{path}: no examples")
    return rows


def load_examples(path: str, graded: bool) -> list[dict]:
    """A local JSONL in GSM8K's format (question, answer ending '#### N') or prompt/answer; every other field
    goes to the reward functions. graded: a built-in correctness reward will read the answers, so each must
    hold one."""
    out = []
    for i, r in read_jsonl(path, {"question": TEXT, "answer": ANSWER}, {"prompt": TEXT, "answer": ANSWER}):
        gsm8k, answer = "question" in r, "" if r["answer"] is None else str(r["answer"])
        if graded and (not answer.strip() or gsm8k and "####" not in answer):
            fail(f"{path}:{i}: answer {r['answer']!r} holds no reference" + (" (GSM8K's ends in '#### N')"
                                                                             if gsm8k else ""))
        out.append({**r, "prompt": r["question" if gsm8k else "prompt"], "answer": R.reference_answer(answer)})
    return out


def load_data(a: Args) -> tuple[list[dict], list[dict]]:
    """(train, eval) examples: dicts with 'prompt' and 'answer' (the reference a reward compares to), and any
    other field of the data file. --eval-dataset replaces any dataset's own held-out prompts."""
    graded = any(name.partition(":")[0] in ("correct", "correct_pm1", "math_verify") for name in a.rewards.split(","))
    evals = load_examples(a.eval_dataset, graded) if a.eval_dataset else []
    if a.dataset == "":
        evals = evals or arithmetic_task(a.eval_prompts, a.seed + 1)
        held = {ex["prompt"] for ex in evals}  # held out: 21 of 256 would otherwise be training prompts too
        train = [ex for ex in arithmetic_task(20000, a.seed) if ex["prompt"] not in held]
    elif a.dataset == "gsm8k":
        try:
            import datasets
            ds = datasets.load_dataset("openai/gsm8k", "main")
        except ImportError:
            fail("--dataset gsm8k needs `pip install datasets`, or pass GSM8K's train.jsonl as --dataset")
        except Exception as e:  # offline, or the hub is down
            fail(f"--dataset gsm8k: loading openai/gsm8k failed ({type(e).__name__}); offline, pass GSM8K's "
                 f"train.jsonl and test.jsonl as --dataset and --eval-dataset")
        split = {s: [{"prompt": r["question"], "answer": R.reference_answer(r["answer"])} for r in ds[s]]
                 for s in ("train", "test")}
        train, evals = split["train"], evals or split["test"]
    else:
        train = load_examples(a.dataset, graded)
    return train, evals[: a.eval_prompts]


def load_teacher_pool(a: Args, train: list[dict]) -> dict[str, list[tuple[str, float]]]:
    """prompt -> [(completion, frozen reward)]; every training prompt must have at least G_t of them."""
    pool: dict[str, list[tuple[str, float]]] = {}
    for i, r in read_jsonl(a.teacher_pool, {"prompt": TEXT, "completion": TEXT, "reward": NUMBER}):
        pool.setdefault(r["prompt"], []).append((r["completion"], float(r["reward"])))
    short = [p for p in dict.fromkeys(ex["prompt"] for ex in train) if len(pool.get(p, ())) < a.teacher_per_group]
    if short:
        fail(f"{len(short)} training prompts have fewer than --teacher-per-group {a.teacher_per_group} completions in "
             f"{a.teacher_pool} (e.g. {short[0][:60]!r} has {len(pool.get(short[0], ()))}): add them to the pool, "
             f"lower --teacher-per-group, or train on the pool's prompts with --dataset")
    return pool


def prompt_stream(data: list[dict], seed: int, start: int = 0):
    """Endless, seeded: every rank draws the same order and takes its own slice of each batch. start:
    prompts already drawn (--resume)."""
    def endless():
        rng = random.Random(seed)
        while True:
            order = list(range(len(data)))
            rng.shuffle(order)
            yield from (data[i] for i in order)
    return itertools.islice(endless(), start, None)


# ----------------------------------------------------------------------------- model
def load_model(a: Args, device: torch.device, resume: str | None = None):
    """Policy (LoRA, QLoRA or full), tokenizer, and a frozen reference only for full fine-tuning with KL.
    resume: a checkpoint directory whose adapter (or whole model) replaces the fresh one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, GenerationConfig
    # bf16 full fine-tuning keeps fp32 weights, since its AdamW updates (~lr = 2e-5 of a weight) are below
    # bf16's 8-bit mantissa and would round to nothing, and runs each forward in bf16 autocast (mixed
    # precision, as HF Trainer's bf16=True). LoRA keeps bf16 base weights; peft keeps adapters in fp32.
    dtype = torch.bfloat16 if use_bf16(a, device) and a.lora_r > 0 else torch.float32
    try:
        tok = AutoTokenizer.from_pretrained(a.model)
    except OSError as e:  # not a local directory, and not on the hub (or no network)
        fail(f"--model {a.model!r}: {str(e).splitlines()[0]}")
    tok.padding_side = "left"  # batched generation appends to the right end of every row
    tok.pad_token = tok.pad_token or tok.eos_token  # safe: completions are masked by position, not by token id
    kw = dict(dtype=dtype, device_map={"": device})
    if a.load_in_4bit:
        kw["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                       bnb_4bit_compute_dtype=dtype, bnb_4bit_use_double_quant=True)
    model = AutoModelForCausalLM.from_pretrained(resume if resume and a.lora_r == 0 else a.model, **kw)
    # which base the run trains (each tensor's shape and first values, in bf16 whatever the dtype), saved with it:
    # on --resume another model at the same path is an error here, not a traceback in peft or a silent run
    saved = json.load(open(os.path.join(resume, "grpo_args.json"))).get("base") if resume else None
    model.base = saved if resume and a.lora_r == 0 else hashlib.sha256(repr([(p.shape, p.detach().flatten()[:16].to(
        torch.bfloat16).tolist()) for p in model.parameters()]).encode()).hexdigest()[:16]
    if saved and model.base != saved:
        fail(f"--resume: --model {a.model!r} is not the base model the saved run trained (other shapes or weights)")
    for m in model.modules():  # bitsandbytes on CPU repacks 4-bit weights in eval mode; training then fails
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    # generate() hands the output layer a strided (B, 1, H) slice; torch's CPU bf16 matmul then copies the
    # frozen weight once per row (4.4 GB for 16 rows at V = 151,936). A contiguous input costs B x H.
    model.get_output_embeddings().register_forward_pre_hook(lambda _, args: (args[0].contiguous(), *args[1:]))
    eos = model.generation_config.eos_token_id  # chat models may end on several tokens
    eos = sorted({tok.eos_token_id, *(eos if isinstance(eos, list) else [eos] if eos is not None else [])})
    # generate() fills every field a call leaves unset from the model's own generation config (Qwen2.5-
    # Instruct's sets repetition_penalty 1.05, top_k 20, ...): keep only its EOS ids, so that sampling
    # follows the policy the loss assumes.
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id)
    if a.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref_model = None
    if a.lora_r > 0:
        import peft
        if a.load_in_4bit:
            model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=a.gradient_checkpointing)
        model = peft.PeftModel.from_pretrained(model, resume, is_trainable=True) if resume else peft.get_peft_model(
            model, peft.LoraConfig(r=a.lora_r, lora_alpha=a.lora_alpha, lora_dropout=a.lora_dropout,
                                   target_modules="all-linear", task_type="CAUSAL_LM"))
    elif a.beta > 0:  # full fine-tuning with KL: a frozen copy of the starting model is the reference
        ref = AutoModelForCausalLM.from_pretrained(a.model, **kw) if resume else copy.deepcopy(model)
        ref_model = ref.eval().requires_grad_(False)
    # from_pretrained returns eval mode, where the layers skip gradient checkpointing and LoRA dropout
    return model.train(), tok, ref_model


def use_bf16(a: Args, device: torch.device) -> bool:
    return a.dtype == "bf16" or (a.dtype == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported())


def autocast(a: Args, device: torch.device):
    """bf16 autocast around full fine-tuning's forwards (its weights stay fp32, see load_model)."""
    return torch.autocast(device.type, torch.bfloat16, enabled=a.lora_r == 0 and use_bf16(a, device))


def make_optimizer(a: Args, model):
    params = [p for p in model.parameters() if p.requires_grad]  # only what trains reaches the optimizer
    kw = dict(lr=a.learning_rate, weight_decay=a.weight_decay)
    if a.optim == "adamw_torch":
        return torch.optim.AdamW(params, **kw)
    import bitsandbytes as bnb
    return (bnb.optim.AdamW8bit if a.optim == "adamw_8bit" else bnb.optim.PagedAdamW8bit)(params, **kw)


# ----------------------------------------------------------------------------- generate
def chat_prompt(tok, prompt: str, system: str) -> str:
    if not tok.chat_template:
        return prompt
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def completion_mask(ids: torch.Tensor, eos_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (N, C) -> mask (N, C): 1 up to and including the first EOS, 0 after; truncated (N,): no EOS.
    By position, never by `ids == pad`: with pad == eos that would drop the EOS, an action to learn."""
    is_eos = torch.isin(ids, torch.as_tensor(eos_ids, device=ids.device))
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), ids.shape[1])  # (N,)
    mask = torch.arange(ids.shape[1], device=ids.device)[None] <= first[:, None]
    return mask, ~is_eos.any(1)


@torch.no_grad()
def generate(model, tok, texts: list[str], n: int, a: Args, greedy: bool = False):
    """n completions per prompt text -> (prompt ids per text, completions cut after the first EOS, truncated,
    the sampler's own log-prob of each completion token at the sampling temperature). With model.sampler (main
    sets it for --compile-generate) every call has one shape, so the decode step compiles once: prompts
    left-padded to the run's longest, rows padded to a multiple of B/ranks x G, a static KV cache. The LoRA stays
    unmerged, and the compiled graph reads the trained weights in place: CUDA graphs capture addresses, so a merged
    or swapped weight tensor would be read stale (and a merge holds a second copy of every weight). What the call
    leaves unset comes from the model's generation config, which load_model cleared."""
    static = getattr(model, "sampler", None)
    enc = tok(texts, return_tensors="pt", padding="max_length" if static else True, add_special_tokens=not
              tok.chat_template, max_length=static and static["prompt_len"]).to(model.device)
    ids, attn = enc.input_ids.repeat_interleave(n, 0), enc.attention_mask.repeat_interleave(n, 0)  # (rows, P)
    extra = -len(ids) % static["rows"] if static else 0  # rows added for the fixed shape, dropped after
    ids, attn = torch.cat([ids, ids[-1:].expand(extra, -1)]), torch.cat([attn, attn[-1:].expand(extra, -1)])
    steps, last = [], []  # log-probs of the drawn tokens: one step's (rows, V) kept at a time, never (rows, T, V)

    def record(input_ids, scores):  # before each draw (raw logits, ahead of the warpers); its input ends with
        if last:                    # the previous draw
            steps.append(last.pop().gather(1, input_ids[:, -1:])[:, 0])
        last.append(torch.log_softmax(scores.float() / a.temperature, -1))
        return scores
    sampling = {} if greedy else dict(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k)
    compiled = dict(cache_implementation="static", compile_config=static["compile_config"]) if static else {}
    was_training = model.training
    model.eval()
    with autocast(a, model.device):
        out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=a.max_new_tokens, do_sample=not greedy,
                             logits_processor=[] if greedy else [record], **sampling, **compiled)
    model.train(was_training)
    if last:  # the last draw; greedy calls (evaluation) record none
        steps.append(last.pop().gather(1, out[:, -1:])[:, 0])
    comp = out[:len(out) - extra, ids.shape[1]:]  # (len(texts)*n, C)
    logp = torch.stack(steps, 1)[:len(comp)] if steps else torch.full(comp.shape, math.nan, device=out.device)
    mask, truncated = completion_mask(comp, model.generation_config.eos_token_id)
    prompts = [ids[m.bool()] for ids, m in zip(enc.input_ids, enc.attention_mask)]
    return prompts, [c[m] for c, m in zip(comp, mask)], truncated.tolist(), [lp[m] for lp, m in zip(logp, mask)]


def compile_sampler(model, a: Args, prompt_len: int, world: int = 1):
    """--compile-generate: from now on every sampling call has one shape (see generate), so transformers compiles
    the decode step once, with CUDA graphs on a GPU; on a CPU (the tests) it is traced, without generated code."""
    from transformers import CompileConfig
    cc = CompileConfig(dynamic=False, **({} if model.device.type == "cuda" else dict(backend="eager", mode=None)))
    cc._compile_all_devices = True
    model.sampler = dict(prompt_len=prompt_len, rows=a.prompts_per_step // world * a.num_generations, compile_config=cc)


def teacher_completion(tok, text: str, eos_id: int, max_new_tokens: int) -> tuple[torch.Tensor, bool]:
    """A cached completion tokenized as the policy would emit it: text + EOS, cut at T (then truncated)."""
    ids = tok(text, add_special_tokens=False).input_ids + [eos_id]
    return torch.tensor(ids[:max_new_tokens]), len(ids) > max_new_tokens


# ----------------------------------------------------------------------------- reward
def build_rewards(a: Args) -> list[tuple[str, object, float]]:
    """[(name, fn, weight)] from --rewards name:weight,... and --reward-fn PATH.py:FUNCTION."""
    fns = []
    for part in filter(None, a.rewards.split(",")):
        name, _, w = part.partition(":")
        if name not in R.REWARDS:
            fail(f"--rewards: unknown reward {name!r}; built-ins are {', '.join(R.REWARDS)}")
        try:
            weight = float(w or 1)
        except ValueError:
            weight = math.nan
        if not math.isfinite(weight):
            fail(f"--rewards: weight {w!r} of {name!r} is not a finite number")
        fns.append((name, R.REWARDS[name], weight))
    if a.reward_fn:
        path, _, fn_name = a.reward_fn.rpartition(":")
        if not path.endswith(".py") or not os.path.isfile(path):
            fail(f"--reward-fn {a.reward_fn!r}: expected an existing PATH.py:FUNCTION")
        try:
            module = runpy.run_path(path)  # the file's globals
        except (Exception, SystemExit) as e:
            fail(f"--reward-fn: importing {path} raised {type(e).__name__}: {e}")
        if not callable(module.get(fn_name)):
            fail(f"--reward-fn: {path} has no function {fn_name!r}")
        fns.append((fn_name, module[fn_name], 1.0))
    return fns


def score(texts: list[str], examples: list[dict], lengths: list[int], reward_fns, a: Args):
    """Rewards (n,) and each function's values. A function gets the completion, the reference answer and, as
    keyword arguments it takes, the prompt and every other field of the example (TRL's convention). A reward
    that raises or is not finite in float32 (the step's dtype) stops the run, named."""
    per_fn = {}
    for name, fn, _ in reward_fns:
        params = inspect.signature(fn).parameters
        takes = lambda k: k != "answer" and (k in params or any(  # noqa: E731
            p.kind == p.VAR_KEYWORD for p in params.values()))
        vals = []
        for text, ex in zip(texts, examples):
            try:
                vals.append(float(fn(text, ex["answer"], **{k: v for k, v in ex.items() if takes(k)})))
            except (Exception, SystemExit) as e:  # a user's reward: report which one and why, then stop
                fail(f"reward {name!r} raised {type(e).__name__}: {e}")
        per_fn[name] = torch.tensor(vals)
        if not per_fn[name].isfinite().all():
            fail(f"reward {name!r} returned {vals[int((~per_fn[name].isfinite()).nonzero()[0])]!r} for a completion; "
                 f"rewards must be finite in float32")
    total = sum((w * per_fn[name] for name, _, w in reward_fns), torch.zeros(len(texts)))
    if a.overlong_penalty:  # DAPO §3.4, L_max = T
        total += torch.tensor([R.overlong_penalty(n, a.max_new_tokens, a.overlong_buffer) for n in lengths])
    if not total.isfinite().all():
        fail("the weighted sum of the rewards is not finite in float32: lower the --rewards weights")
    return total, per_fn


# ----------------------------------------------------------------------------- advantage
def group_advantages(rewards: torch.Tensor, scale: str = "std", eps: float = 1e-6) -> torch.Tensor:
    """rewards (B, G) -> adv (B, G). GRPO (2402.03300) §4.1.2: (R - mean) / (std + eps), std unbiased
    (torch's default, as TRL and verl). scale='none', Dr. GRPO (2503.20783) §3.1: R - mean."""
    adv = rewards - rewards.mean(1, keepdim=True)
    return adv / (rewards.std(1, keepdim=True) + eps) if scale == "std" else adv


def soft_weights(stds: torch.Tensor, max_std=None, eps: float = 1e-6) -> torch.Tensor:
    """Dr. GRPO+ soft reweighting (seed 004): w_g = std_g / (max_g' std_g' + eps), the max over the
    step's groups (pass it when they are spread over ranks)."""
    return stds / ((stds.max() if max_std is None else max_std) + eps)


def group_metrics(groups: list[dict]) -> dict:
    """Reward, accuracy and length metrics over every rank's groups; per source in the mixed pool."""
    rows = [(float(r), len(c), t, te, R.is_correct(x, g["answer"]), bool(g["rewards"].max() == g["rewards"].min()))
            for g in groups for r, c, t, te, x in zip(g["rewards"], g["completions"], g["truncated"],
                                                       g["is_teacher"], g["texts"])]
    rows = torch.tensor(sum(all_gather(rows), []), dtype=torch.float64)  # one row per completion, every rank's
    reward, length, truncated, teacher, correct, equal = rows.T
    student = teacher == 0
    out = {"reward/mean": reward.mean().item(), "reward/std": reward.std().item(),
           "groups/equal_frac": equal.mean().item(), "accuracy": correct[student].mean().item(),
           "completion/tokens": length[student].sum().item(), "completion/mean_length": length[student].mean().item(),
           "completion/max_length": length[student].max().item(),
           "completion/truncated_frac": truncated[student].mean().item()}
    for src, part in (("student", student), ("teacher", ~student)) if teacher.any() else ():
        out[f"reward/mean_{src}"] = reward[part].mean().item()
        out[f"completion/mean_length_{src}"] = length[part].mean().item()
    for name in groups[0]["per_fn"]:
        vals = sum(all_gather([v for g in groups for v in g["per_fn"][name].tolist()]), [])
        out[f"reward/{name}"] = sum(vals) / len(vals)
    return out


def rollout(model, tok, stream, reward_fns, pool, a: Args, rank=0, world=1, rng=None):
    """Generate and score this rank's groups for one step, then filter them and compute advantages. Returns
    the kept groups (each with "adv"), the step's metrics, and every group generated, kept or not.
    A group: one prompt, G = G_s student + G_t teacher rows, rewards (G,), adv (G,)."""
    rng = rng or random.Random(a.seed + 1000 * rank)
    G_s, generated, t_gen, t_rew = a.num_generations, [], 0.0, 0.0
    for rounds in range(1, a.max_gen_rounds + 1):
        batch = [next(stream) for _ in range(a.prompts_per_step)][rank::world]  # whole groups per rank
        t0 = time.time()
        prompts, comps, truncated, logps = generate(model, tok, [chat_prompt(tok, ex["prompt"], a.system_prompt)
                                                                for ex in batch], G_s, a)
        t1 = time.time()
        texts = tok.batch_decode(comps, skip_special_tokens=True)
        rewards, per_fn = score(texts, [ex for ex in batch for _ in range(G_s)], [len(c) for c in comps], reward_fns, a)
        for i, ex in enumerate(batch):
            rows = slice(i * G_s, (i + 1) * G_s)
            # mixed pool, seed 003: G_t cached teacher completions, with their frozen rewards, join the group
            picks = rng.sample(pool[ex["prompt"]], a.teacher_per_group) if pool else []
            cached = [teacher_completion(tok, text, tok.eos_token_id, a.max_new_tokens) for text, _ in picks]
            generated.append(dict(
                prompt=ex["prompt"], answer=ex["answer"], prompt_ids=prompts[i],
                completions=comps[rows] + [ids for ids, _ in cached], truncated=truncated[rows] + [c for _, c in cached],
                sampler_logp=logps[rows] + [torch.full((len(ids),), math.nan) for ids, _ in cached],  # teacher: none
                texts=texts[rows] + [text for text, _ in picks], is_teacher=[False] * G_s + [True] * len(picks),
                rewards=torch.cat([rewards[rows], torch.tensor([r for _, r in picks])]),
                per_fn={k: v[rows] for k, v in per_fn.items()}))
        t_gen, t_rew = t_gen + t1 - t0, t_rew + time.time() - t1
        # DAPO §3.2 dynamic sampling: keep groups whose rewards are not all equal; refill until B are kept
        groups = [g for g in generated if not a.dynamic_sampling or g["rewards"].max() > g["rewards"].min()]
        if all_sum(torch.tensor([len(groups)], device=model.device)).item() >= a.prompts_per_step:
            break
    groups = groups[: max(0, a.prompts_per_step - sum(all_gather(len(groups))[:rank]))]  # B in all, lower ranks first
    # the step's filters and weights look at every rank's groups: gather the per-group stds (small)
    everyone = all_gather([g["rewards"].std().item() for g in groups])
    stds = torch.tensor(sum(everyone, []))
    if a.top_k_groups:  # seed 004 hard filter: the k groups with the largest std, ties to the lower index
        top = set(torch.argsort(stds, descending=True, stable=True)[: a.top_k_groups].tolist())
        offset = sum(len(r) for r in everyone[:rank])
        groups = [g for i, g in enumerate(groups, offset) if i in top]
        stds = stds[sorted(top)]
    for g in groups:  # one advantage over the G_s + G_t rows
        g["adv"] = group_advantages(g["rewards"][None], a.scale, a.std_eps)[0]
        if a.soft_reweight:
            g["adv"] *= soft_weights(g["rewards"].std(), stds.max(), a.std_eps)
    stats = {"groups/kept": len(stds), "groups/gen_rounds": rounds, "time/generate": t_gen, "time/reward": t_rew,
             **group_metrics(generated)}  # every completion generated, kept or not
    if a.soft_reweight and len(stds):
        w = soft_weights(stds, eps=a.std_eps)
        stats.update({"adv/soft_weight_min": w.min().item(), "adv/soft_weight_mean": w.mean().item(),
                      "adv/soft_weight_max": w.max().item()})
    return groups, stats, generated


def collate(groups: list[dict], pad_id: int, device) -> dict:
    """Groups -> padded tensors: prompt left-padded, completion right-padded. N = sum of group sizes (0 when a
    rank kept no group: it still joins the step's reductions)."""
    prompts = [g["prompt_ids"] for g in groups for _ in g["completions"]]
    comps = [c for g in groups for c in g["completions"]]
    P, C = max(map(len, prompts), default=0), max(map(len, comps), default=0)
    ids = torch.full((len(comps), P + C), pad_id, dtype=torch.long)
    attn = torch.zeros(len(comps), P + C, dtype=torch.long)
    mask, sampler = torch.zeros(len(comps), C), torch.full((len(comps), C), math.nan)
    for i, (p, c, s) in enumerate(zip(prompts, comps, [s for g in groups for s in g["sampler_logp"]])):
        ids[i, P - len(p):P], ids[i, P:P + len(c)], sampler[i, :len(c)] = p, c, s
        attn[i, P - len(p):] = 1  # after-EOS padding stays attended: causal, masked out of the loss
        mask[i, :len(c)] = 1
    flat = lambda key, dtype: torch.tensor([float(x) for g in groups for x in g[key]], dtype=dtype)  # noqa: E731
    equal = [g["rewards"].max() == g["rewards"].min() for g in groups for _ in g["completions"]]
    return {k: v.to(device) for k, v in dict(
        input_ids=ids, attention_mask=attn, mask=mask, adv=flat("adv", torch.float32),  # (N, P+C), (N, C), (N,)
        sampler_logp=sampler,  # (N, C); NaN where unknown (teacher rows)
        truncated=flat("truncated", torch.bool), is_teacher=flat("is_teacher", torch.bool),
        zero_variance=torch.tensor(equal, dtype=torch.bool)).items()}


# ----------------------------------------------------------------------------- log-probs
def token_logps(model, input_ids, attention_mask, n_completion: int, temperature: float = 1.0):
    """Log-probs and entropy (N, C) of the last C tokens, from one forward over prompt + completion.
    Position ids count real tokens, as generate() did with left padding. The vocabulary is wide
    (V = 151,936 for Qwen2.5), so the output layer runs on chunks of 2^24 / V tokens (64 MB of fp32
    logits), each recomputed in backward rather than kept: no (N, C, V) logits are ever held."""
    pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos,
                                 use_cache=False).last_hidden_state[:, -n_completion - 1:-1]  # (N, C, H)
    head = model.get_output_embeddings()
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), input_ids[:, -n_completion:].reshape(-1)  # (N*C, H), (N*C,)

    def chunk(h, tgt):  # (n, H), (n,) -> logp, entropy (n,): hidden state t predicts token t+1
        logits = head(h).float() / temperature  # (n, V)
        lse = logits.logsumexp(-1)
        with torch.no_grad():  # entropy from the same logits: a metric, no extra pass
            entropy = lse - (logits.softmax(-1) * logits).sum(-1)
        return logits.gather(-1, tgt[:, None])[:, 0] - lse, entropy
    n = max(1, 2 ** 24 // head.weight.shape[0])  # tokens a chunk
    logp, entropy = zip(*[checkpoint(chunk, h, t, use_reentrant=False) for h, t in zip(hidden.split(n),
                                                                                       targets.split(n))])
    return torch.cat(logp).view(len(input_ids), -1), torch.cat(entropy).view(len(input_ids), -1)


# ----------------------------------------------------------------------------- loss
def policy_loss(logp, old_logp, adv, mask, a: Args):
    """Per-token policy loss (N, C), each choice its own flag; adv (N, 1). Also where the ratio left
    [1 - eps_low, 1 + eps_high] on the side that matters (below with A < 0, above with A > 0).
    With old_logp = logp.detach() (num_iterations 1, r = 1) every choice has the gradient -A grad log pi.
      ratio      token: r_t = pi / pi_old                                PPO, GRPO
                 sequence: s_i = exp(mean_t log r_t) at every token       GSPO (2507.18071) eq. 7
      surrogate  clip: -min(r A, clip(r, 1-eps_low, 1+eps_high) A)       PPO; DAPO §3.1 clip-higher
                 cispo: -sg(clip(r, 1-eps_low, 1+eps_high)) A log pi      MiniMax-M1 (2506.13585) eq. 4
                 sapo: -(4/tau) sigmoid(tau (r - 1)) A, tau by A's sign   SAPO (2511.20347)
      dual_clip  c: where A < 0 the loss is at most c |A|                 Dual-clip PPO (1912.09729)"""
    log_ratio = torch.where(mask != 0, logp - old_logp, 0)  # (N, C)
    if a.ratio == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # (N, 1)
    ratio = torch.exp(log_ratio).expand_as(logp)
    clipped = torch.clamp(ratio, 1 - a.eps_low, 1 + a.eps_high)
    if a.surrogate == "cispo":
        loss = -clipped.detach() * adv * logp
    elif a.surrogate == "sapo":
        tau = torch.where(adv > 0, a.sapo_tau_pos, a.sapo_tau_neg)
        loss = -(4 / tau) * torch.sigmoid(tau * (ratio - 1)) * adv
    else:
        loss = -torch.min(ratio * adv, clipped * adv)
    if a.dual_clip:
        loss = torch.where(adv < 0, torch.minimum(loss, -a.dual_clip * adv), loss)
    return loss, (ratio < 1 - a.eps_low) & (adv < 0), (ratio > 1 + a.eps_high) & (adv > 0)


def kl_penalty(logp, ref_logp, kind: str = "k3", old_logp=None):
    """Per-token KL term (Schulman's estimators), with d = log ref - log pi; its gradient under samples of pi:
      k3        e^d - d - 1: an unbiased VALUE of KL(pi || ref), GRPO (2402.03300) eq. 4; but its gradient
                (1 - ref/pi) grad log pi has the mean grad KL(ref || pi), the reverse direction
      k3_ratio  k3 · pi / pi_old, the policy loss's ratio (TRL's use_bias_correction_kl, DeepSeek-V3.2): its
                gradient -(pi / pi_old) d grad log pi has the mean grad KL(pi || ref) under samples of pi_old.
                Written so (k3's value, -d's gradient): differentiating k3 · ratio as is would cancel
                (1 - e^d) + (e^d - d - 1) in floating point, which loses all of -d past |d| ~ 20 in fp32
      k2        d^2 / 2: gradient -d grad log pi, whose mean is grad KL(pi || ref)"""
    d = ref_logp - logp
    if kind == "k2":
        return d * d / 2
    k3 = torch.exp(d) - d - 1
    if kind != "k3_ratio":
        return k3
    ratio = torch.exp(logp.detach() - (logp.detach() if old_logp is None else old_logp))
    return ratio * (k3.detach() - d.detach() * (logp - logp.detach()))


def aggregate_loss(loss, mask, mode: str, max_len: int, n_seqs=None, n_tokens=None):
    """Token losses (N, C) -> scalar, with verl's names. n_seqs / n_tokens are the normalisers of the
    WHOLE step (every micro-batch, every rank); by default this batch's. Sequences with no loss
    token count in neither.
      token-mean               Σ_i Σ_t l / Σ_i |o_i|                DAPO §3.3
      seq-mean-token-mean      Σ_i (Σ_t l / |o_i|) / n_seq          GRPO
      seq-mean-token-sum       Σ_i Σ_t l / n_seq                    seed 004
      seq-mean-token-sum-norm  Σ_i Σ_t l / (n_seq * max_len)        Dr. GRPO, max_len = T"""
    n_seqs = (mask.sum(-1) > 0).sum() if n_seqs is None else n_seqs
    n_tokens = mask.sum() if n_tokens is None else n_tokens
    per_seq = torch.where(mask != 0, loss * mask, 0).sum(-1)  # (N,); a NaN or inf past EOS must not leak in
    if mode == "token-mean":
        return per_seq.sum() / max(n_tokens, 1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1)
    return per_seq.sum() / (max(n_seqs, 1) * (max_len if mode == "seq-mean-token-sum-norm" else 1))


# ----------------------------------------------------------------------------- step
def edit_source_grads(g_s: list, g_t: list) -> list:
    """FORKER: the per-source gradients, summed over micro-batches and ranks, before clipping and the
    step. g_s + g_t is the full-batch gradient; inspect, project or drop either part here."""
    return [s + t for s, t in zip(g_s, g_t)]


def train_step(model, ref_model, opt, batch: dict, a: Args) -> dict:
    """num_iterations optimizer steps on one rollout batch; returns the step's metrics (all ranks)."""
    params = [p for p in model.parameters() if p.requires_grad]
    dev, mask = params[0].device, batch["mask"]
    if a.mask_truncated:  # DAPO §3.4 overlong filtering
        mask = mask * ~batch["truncated"][:, None]
    # normalisers of the whole step: every row (skipped ones too), summed over ranks
    n_seqs, n_tokens = all_sum(torch.stack([(mask.sum(-1) > 0).sum().float(), mask.sum()])).tolist()
    # zero-variance skip (seed 003): equal rewards -> adv = 0 -> no policy gradient; exact with beta = 0
    skip = batch["zero_variance"] & (a.skip_zero_variance and a.beta == 0)
    rows = ((mask.sum(-1) > 0) & ~skip).nonzero()[:, 0].tolist()
    chunks = [rows[i:i + a.micro_batch_size] for i in range(0, len(rows), a.micro_batch_size)]

    def forward(idx, net):
        with autocast(a, dev):
            return token_logps(net, batch["input_ids"][idx], batch["attention_mask"][idx], mask.shape[1], a.temperature)

    with torch.no_grad():  # per micro-batch, once, before the first update
        old_logp = [forward(idx, model)[0] for idx in chunks] if a.num_iterations > 1 else None
        # the KL reference: the policy with its LoRA adapter off (no second copy), else a frozen copy
        with model.disable_adapter() if a.beta > 0 and ref_model is None else contextlib.nullcontext():
            ref_logp = [forward(idx, ref_model or model)[0] for idx in chunks] if a.beta > 0 else None
    # entropy, clip_low, clip_high, kl, loss (token sums), tokens, rows, |old - sampler| sum, tokens with a sampler
    sums, gap_max = torch.zeros(9, device=dev), torch.zeros((), device=dev)
    for _ in range(a.num_iterations):
        g_s = [torch.zeros_like(p) for p in params] if a.split_grads else None
        g_t = [torch.zeros_like(p) for p in params] if a.split_grads else None
        for p in params:
            p.grad = torch.zeros_like(p)
        sums.zero_()
        gap_max.zero_()
        for j, idx in enumerate(chunks):
            m, adv = mask[idx], batch["adv"][idx][:, None]  # (n, C), (n, 1)
            logp, entropy = forward(idx, model)
            # num_iterations = 1: old_logp = logp.detach(), ratio = 1, no extra forward. For teacher rows
            # the old policy is the CURRENT one too (ratio = 1 forced): on them this is advantage-weighted
            # imitation of fixed completions, not on-policy GRPO (seed 003 review).
            old = logp.detach() if old_logp is None else old_logp[j]
            loss, clip_low, clip_high = policy_loss(logp, old, adv, m, a)
            # the sampler's own log-probs: their gap to the trainer's is the fast sampler's health check (a stale
            # weight or a broken cache shows here first); teacher rows have none (NaN)
            sampler = batch["sampler_logp"][idx]
            known = (m > 0) & sampler.isfinite()
            gap = torch.where(known, (old - sampler).abs(), 0)
            if a.tis:  # truncated importance sampling (2025, Yao et al.; TRL's vllm_importance_sampling_correction)
                loss = loss * torch.where(known, torch.exp(old - sampler).clamp(max=a.tis), 1)
            # KL only where the mask is on: past EOS, exp(ref - logp) can overflow and its gradient would be NaN
            ref = torch.where(m > 0, ref_logp[j], logp.detach()) if a.beta > 0 else logp.detach()
            loss = loss + a.beta * kl_penalty(logp, ref, a.kl, old)  # beta 0: adds exactly 0, value and gradient
            kl = kl_penalty(logp.detach(), ref)  # the metric: k3, an unbiased value of KL(pi || ref), for any --kl
            total = lambda part: aggregate_loss(loss, m * part, a.loss_agg, a.max_new_tokens, n_seqs, n_tokens)  # noqa
            if a.split_grads:  # seed 003: same normaliser; grads harvested and reset between the passes,
                teacher = batch["is_teacher"][idx][:, None].float()  # else the second holds g_s + g_t
                for part, acc, last in ((1 - teacher, g_s, False), (teacher, g_t, True)):
                    total(part).backward(retain_graph=not last)
                    for p, g in zip(params, acc):
                        g += p.grad
                        p.grad.zero_()
            else:
                total(1).backward()
            with torch.no_grad():
                sums += torch.stack([(x.float() * m).sum() for x in (entropy, clip_low, clip_high, kl, loss)]
                                    + [m.sum(), torch.tensor(len(idx), device=dev), gap.sum(), known.sum()])
                gap_max = torch.maximum(gap_max, gap.max())
        # the gradient of the whole step is the SUM of the ranks' (each rank's loss already carries the
        # global normaliser): one all_reduce per tensor after accumulation, where DDP would average inside
        # backward. Ranks may run different numbers of micro-batches (zero-variance skip, refill), so the
        # reduce happens once, here.
        grads = (g_s + g_t) if a.split_grads else [p.grad for p in params]
        for g in grads:
            all_sum(g)
        out = {}
        if a.split_grads:
            ns, nt = torch.sqrt(sum((g * g).sum() for g in g_s)), torch.sqrt(sum((g * g).sum() for g in g_t))
            dot = sum((s * t).sum() for s, t in zip(g_s, g_t))
            out = {"grad/norm_student": ns.item(), "grad/norm_teacher": nt.item(),
                   "grad/cos_student_teacher": (dot / (ns * nt).clamp(min=1e-30)).item()}
            for p, g in zip(params, edit_source_grads(g_s, g_t)):
                p.grad = g
        norm, s = torch.nn.utils.clip_grad_norm_(params, a.max_grad_norm or math.inf).item(), all_sum(sums).tolist()
        if not math.isfinite(norm + s[4]):  # never applied: the weights and the optimizer's state stay as they were
            return {"train/not_finite": 1.0, "train/rows": s[6]}
        out["grad/norm"] = norm
        opt.step()
        opt.zero_grad(set_to_none=True)
    if s[8]:  # over the trained student tokens
        out.update({"sampler/logp_gap": s[7] / s[8], "sampler/logp_gap_max": max(all_gather(gap_max.item()))})
    if not s[5]:  # no loss token this step (every group skipped): no policy metrics, rather than zeros
        return {**out, "train/rows": 0.0}
    return {**out, "loss": s[4] / s[5], "policy/entropy": s[0] / s[5], "loss/clipfrac_low": s[1] / s[5],
            "loss/clipfrac_high": s[2] / s[5], "kl": s[3] / s[5], "train/rows": s[6]}


# ----------------------------------------------------------------------------- loop
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, 2107.03374 eq. 1)."""
    return 1 - math.comb(n - c, k) / math.comb(n, k)


def sample_rows(groups: list[dict], step: int) -> list[dict]:
    """samples.jsonl: one row per completion (teacher rows: no per-function rewards; filtered groups: no adv)."""
    return [{"step": step, "prompt": g["prompt"], "completion": text, "teacher": teacher,
             "rewards": None if teacher else {k: v[i].item() for k, v in g["per_fn"].items()},
             "reward": g["rewards"][i].item(), "adv": g["adv"][i].item() if "adv" in g else None,
             "length": len(g["completions"][i]), "truncated": bool(g["truncated"][i])}
            for g in groups for i, (text, teacher) in enumerate(zip(g["texts"], g["is_teacher"]))]


def sample_table(rows: list[dict]) -> str:
    """One group as a short table: the head of each completion, each reward function's value, the total."""
    names = list(next(r["rewards"] for r in rows if r["rewards"]))
    lines = [f"prompt: {rows[0]['prompt'][:100]!r}", f"{'completion':<52}" + "".join(f"{n[:12]:>13}" for n in names)
             + f"{'total':>8}"]
    for r in rows:
        vals = [f"{r['rewards'][n]:>13.3g}" if r["rewards"] else f"{'teacher':>13}" for n in names]
        lines.append(f"{r['completion'][:50]!r:<52}"[:52] + "".join(vals) + f"{r['reward']:>8.3g}")
    return "\n".join(lines)


@torch.no_grad()
def evaluate(model, tok, examples: list[dict], a: Args, rank: int, world: int) -> dict:
    """Greedy accuracy on held-out prompts, split over ranks. With --eval-samples k, also k completions per
    prompt at the training temperature: mean@k (= pass@1) and pass@j for j = 2, 4, ..., k, as papers report.
    Those samples draw on a random stream of their own: the run's is untouched, so resume stays exact."""
    mine, k = examples[rank::world], a.eval_samples
    rows = a.prompts_per_step // world * a.num_generations  # a rollout's rows a call: the compiled sampler's shape
    greedy, sampled = [], []  # correct completions per prompt

    def n_correct(chunk, n, **kw):
        texts = [chat_prompt(tok, ex["prompt"], a.system_prompt) for ex in chunk]
        comps = generate(model, tok, texts, n, a, **kw)[1]
        texts = tok.batch_decode(comps, skip_special_tokens=True)
        return [sum(R.is_correct(t, ex["answer"]) for t in texts[i * n:(i + 1) * n]) for i, ex in enumerate(chunk)]
    with torch.random.fork_rng([model.device] if model.device.type == "cuda" else []):
        torch.manual_seed(a.seed + 1000 * rank + 999)
        for i in range(0, len(mine), rows):
            greedy += n_correct(mine[i:i + rows], 1, greedy=True)
        for i in range(0, len(mine), max(1, rows // k)) if k else ():
            sampled += n_correct(mine[i:i + max(1, rows // k)], k)
    greedy, sampled = sum(all_gather(greedy), []), sum(all_gather(sampled), [])
    out = {"eval/accuracy": sum(greedy) / len(greedy)}
    if k:
        out[f"eval/mean@{k}"] = sum(sampled) / (k * len(sampled))
        for j in sorted({k} | {2 ** e for e in range(1, k.bit_length())} - {1}):
            out[f"eval/pass@{j}"] = sum(pass_at_k(k, c, j) for c in sampled) / len(sampled)
    return out


def find_checkpoint(output_dir: str) -> tuple[str | None, list[str]]:
    """The checkpoint --resume continues: checkpoint/, else checkpoint.old/ (left whole when a save was killed
    between its renames), the first one whole: each JSON file parses, each safetensors file holds what its header
    says, trainer_state.pt opens (mapped, not read). And what is wrong with those that are not."""
    from safetensors import safe_open
    problems = []
    for ckpt in (os.path.join(output_dir, name) for name in ("checkpoint", "checkpoint.old")):
        for name in ["grpo_args.json", "trainer_state.pt"] + sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else []:
            path, kind = os.path.join(ckpt, name), os.path.splitext(name)[1]
            try:
                with open(path, "rb") as f:
                    json.load(f) if kind == ".json" else safe_open(path, "pt") if kind == ".safetensors" else \
                        torch.load(path, mmap=True, weights_only=False) if kind == ".pt" else None
            except Exception as e:
                problems.append(f"{path} is " + ("missing" if isinstance(e, FileNotFoundError) else
                                                 f"damaged ({type(e).__name__}: {str(e)[:80]})"))
                break
        else:
            if os.path.isdir(ckpt):
                return ckpt, problems
    return None, problems


def save(model, tok, a: Args, state: dict):
    """checkpoint/: weights (adapter or model), tokenizer, grpo_args.json (the flags, the step, the base model's
    fingerprint), trainer_state.pt (step, prompts drawn, optimizer, every rank's RNG). Written to checkpoint.tmp/
    and swapped in by two renames, so at every instant one whole checkpoint exists: checkpoint/, or
    checkpoint.old/ between the renames (where --resume looks next). The leftovers of a killed save are cleared
    by the next one. Never from weights that are not finite; a failed write (a full disk) keeps the last one."""
    if not all(p.isfinite().all() for p in model.parameters() if p.requires_grad):
        fail(f"the weights are not finite at step {state['step']}: nothing saved over the last checkpoint")
    final = os.path.join(a.output_dir, "checkpoint")
    tmp, old = final + ".tmp", final + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        torch.save(state, os.path.join(tmp, "trainer_state.pt"))
        with open(os.path.join(tmp, "grpo_args.json"), "w") as f:
            json.dump({**dataclasses.asdict(a), "step": state["step"], "base": getattr(model, "base", None)}, f,
                      indent=1)
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as "unexpected pos ..."
        full = shutil.disk_usage(a.output_dir).free < 2 ** 24
        shutil.rmtree(tmp, ignore_errors=True)
        fail(f"saving step {state['step']} failed: {'the disk is full' if full else f'{type(e).__name__}: {e}'}; "
             f"the last whole checkpoint is {find_checkpoint(a.output_dir)[0] or 'none'}")
    if os.path.isdir(final):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def check_paths(a: Args):
    """Before anything is loaded or written: the output dir, and a local model directory."""
    d, parent = a.output_dir, os.path.abspath(a.output_dir)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        fail(f"--output-dir {d!r}: {parent} is a file: pick a directory")
    if not os.access(parent, os.W_OK):
        fail(f"--output-dir {d!r}: {parent} is not writable")
    previous = [n for n in ("checkpoint", "checkpoint.old") if os.path.exists(os.path.join(d, n))]
    if previous and not (a.resume or a.overwrite):  # (metrics alone: a run that stopped before its first save)
        fail(f"--output-dir {d!r} holds a previous run ({', '.join(previous)}): add --resume to continue it, "
             f"--overwrite to start over, or pick another --output-dir")
    if os.path.isfile(os.path.join(a.model, "adapter_config.json")):
        fail(f"--model {a.model!r} is a LoRA adapter, not a model: --resume --output-dir continues the run that "
             f"saved it; to start from it, save PeftModel.from_pretrained(base, it).merge_and_unload() first")
    if os.path.isdir(a.model):
        if not any(os.path.isfile(os.path.join(a.model, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
            fail(f"--model {a.model!r} has no tokenizer (tokenizer.json): save it beside the weights")
    elif a.model.startswith((".", "/", "~")) or a.model.count("/") > 1:  # a hub id is NAME or ORG/NAME
        fail(f"--model {a.model!r}: no such directory")


def lock(output_dir: str):
    """One run per output dir: an exclusive lock on output_dir/.lock, held for the run's life (the OS releases it
    however the process ends); it holds the PID that a second run names when it fails."""
    import fcntl
    f = open(os.path.join(output_dir, ".lock"), "a+", buffering=1)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fail(f"--output-dir {output_dir!r} is in use by a run (PID {open(f.name).read().strip()}): wait or stop it")
    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    return f


def open_log(a: Args, name: str, step: int):
    """A JSONL log in the output dir; on --resume it keeps the saved run's rows up to its checkpoint's step (and
    drops a partial last line, which a crash mid-write leaves)."""
    path = os.path.join(a.output_dir, name)
    rows = open(path).readlines() if a.resume and os.path.exists(path) else []
    with open(path + ".tmp", "w") as f:
        f.writelines(row for row in rows if row.endswith("}\n") and json.loads(row)["step"] <= step)
    os.replace(path + ".tmp", path)
    return open(path, "a", buffering=1)  # line-buffered: each row is on disk once written


# bf16 keeps 8 bits of mantissa: a logit near 20 is off by up to 0.06, and so is a log-prob; the sampler's decode
# kernels and the trainer's full forward round apart, and the mean gap over a step's tokens is a few hundredths
# (0.01 on the test model). Stale weights or a broken cache move it by tenths to nats.
GAP_LIMIT = 0.25


def main(argv=None):
    a = parse_args(argv)
    if a.dry_run:
        print(json.dumps(dataclasses.asdict(a), indent=1))
        print(describe_objective(a))
        return
    ckpt = find_checkpoint(a.output_dir)[0] if a.resume else None
    if ckpt and json.load(open(os.path.join(ckpt, "grpo_args.json")))["step"] >= a.max_steps:
        return print(f"grpo: the run in {a.output_dir} has done its --max-steps {a.max_steps}: raise it to go on")
    check_paths(a)
    rank, world, device = setup_distributed()
    if a.prompts_per_step % world:
        fail(f"--prompts-per-step {a.prompts_per_step} must divide over {world} ranks (whole groups per rank)")
    train, evals = load_data(a)
    pool = load_teacher_pool(a, train) if a.teacher_pool else None
    reward_fns = build_rewards(a)
    score([train[0]["answer"], ""], [train[0]] * 2, [1, 1], reward_fns, a)  # fail early, not at step 1
    if a.wandb_project and rank == 0 and importlib.util.find_spec("wandb") is None:
        fail("--wandb-project needs `pip install wandb`")
    random.seed(a.seed)
    torch.manual_seed(a.seed)  # same LoRA init on every rank
    model, tok, ref_model = load_model(a, device, ckpt)
    longest = max(len(ids) for ids in tok([chat_prompt(tok, ex["prompt"], a.system_prompt) for ex in train + evals],
                                          add_special_tokens=not tok.chat_template).input_ids)
    if longest + a.max_new_tokens > getattr(model.config, "max_position_embeddings", math.inf):
        fail(f"the longest prompt is {longest} tokens (chat template included): with --max-new-tokens "
             f"{a.max_new_tokens} that passes the model's {model.config.max_position_embeddings} positions")
    if a.compile_generate == "on" or a.compile_generate == "auto" and device.type == "cuda":
        why = ("transformers cannot compile bitsandbytes' 4-bit layers" if a.load_in_4bit else
               "a static KV cache has one dtype, and bf16 autocast over fp32 weights (full fine-tuning) makes two"
               if a.lora_r == 0 and use_bf16(a, device) else "")
        if why:
            print(f"grpo: note: {why}: sampling uncompiled", file=sys.stderr)
        else:
            compile_sampler(model, a, longest, world)
    opt = make_optimizer(a, model)
    torch.manual_seed(a.seed + 1000 * rank)  # sampling differs per rank, repeats per run
    teacher_rng = random.Random(a.seed + 1000 * rank)
    done = {"step": 0, "prompts_drawn": 0}  # the last completed step
    if ckpt:
        state = torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)
        if len(state["rng"]) != world:
            fail(f"--resume: the saved run ran on {len(state['rng'])} processes, this one on {world}: use as many")
        opt.load_state_dict(state["optimizer"])
        cpu, cuda, python, teacher = state["rng"][rank]
        torch.set_rng_state(cpu), random.setstate(python), teacher_rng.setstate(teacher)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)
        done = {k: state[k] for k in done}
    stream = prompt_stream(train, a.seed, done["prompts_drawn"])
    # every check has passed: only now is the output dir written, and by one run at a time
    os.makedirs(a.output_dir, exist_ok=True)
    lock_file = lock(a.output_dir) if rank == 0 else None  # held for the run's life
    if a.overwrite and rank == 0:
        for name in ("checkpoint", "checkpoint.tmp", "checkpoint.old"):
            shutil.rmtree(os.path.join(a.output_dir, name), ignore_errors=True)
    log = open_log(a, "metrics.jsonl", done["step"]) if rank == 0 else None
    samples = open_log(a, "samples.jsonl", done["step"]) if rank == 0 else None  # empty without --log-samples
    if a.wandb_project and rank == 0:
        import wandb
        wandb.init(project=a.wandb_project, config=dataclasses.asdict(a))
    stop = []  # Ctrl-C or SIGTERM: finish this step, save, exit 128 + signal; a second one stops at once
    where = f"{os.path.join(a.output_dir, 'checkpoint')}; metrics in {os.path.join(a.output_dir, 'metrics.jsonl')}"

    def on_signal(sig, _):
        if stop:  # the checkpoint on disk is whole at every instant (see save)
            print(f"\ngrpo: stopped at once; the last checkpoint is in {where}", file=sys.stderr)
            os._exit(128 + sig)
        stop.append(sig)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    if a.eval_every and not evals and rank == 0:
        print("grpo: note: no held-out prompts, so no evaluation: give --eval-dataset", file=sys.stderr)
    from tqdm import tqdm
    bar = tqdm(range(done["step"] + 1, a.max_steps + 1), disable=rank != 0, desc=f"{a.algo}", dynamic_ncols=True)
    start, busy, warned, bad_steps = done["step"], "", set(), 0
    if a.eval_every and evals and start == 0:  # where the run starts from, as papers report it
        m = evaluate(model, tok, evals, a, rank, world)
        if rank == 0:
            log.write(json.dumps({"step": 0, **m}) + "\n")
    try:
        for step in bar:
            t0 = time.time()
            groups, m, generated = rollout(model, tok, stream, reward_fns, pool, a, rank, world, teacher_rng)
            if step == start + 1 and rank == 0:  # a broken reward or chat template shows here, not an hour later
                bar.write(sample_table(sample_rows(generated[:1], step)), sys.stderr)
            t1 = time.time()
            m["lr"] = a.learning_rate * min(1, step / max(1, a.warmup_steps))  # linear warm-up, then constant
            for g in opt.param_groups:
                g["lr"] = m["lr"]
            busy = "train"
            if m["groups/kept"]:  # the same on every rank; 0 when dynamic sampling kept nothing by its cap
                m.update(train_step(model, ref_model, opt, collate(groups, tok.pad_token_id, device), a))
            busy = ""
            if m.get("sampler/logp_gap", 0) > GAP_LIMIT:
                fail(f"the sampler's log-probs are {m['sampler/logp_gap']:.3f} nat from the trainer's on average (bf16 "
                     f"noise is a few hundredths): stale weights or a broken KV cache; --compile-generate off to go on")
            bad_steps = bad_steps + 1 if "train/not_finite" in m else 0
            if bad_steps == 3:
                fail("3 steps in a row had a loss or gradient that was not finite, and none was applied: lower "
                     "--learning-rate, or check the rewards and --log-samples")
            cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None  # every random state a step uses
            done = {"step": step, "prompts_drawn": done["prompts_drawn"] + m["groups/gen_rounds"] * a.prompts_per_step,
                    "rng": all_gather((torch.get_rng_state(), cuda, random.getstate(), teacher_rng.getstate()))}
            m["time/train"] = time.time() - t1
            m["tokens_per_second"] = m["completion/tokens"] / (time.time() - t0)
            if a.eval_every and evals and (step % a.eval_every == 0 or step == a.max_steps):
                m.update(evaluate(model, tok, evals, a, rank, world))
            stopping = bool(all_sum(torch.tensor([float(len(stop))], device=device)).item())
            if rank == 0:
                m = {"step": step, **m}
                log.write(json.dumps(m) + "\n")
                samples.writelines(json.dumps(r) + "\n" for r in sample_rows(generated[: a.log_samples], step))
                for bad, msg in [
                        (m["completion/truncated_frac"] > 0.5, f"more than half the completions hit --max-new-tokens "
                         f"{a.max_new_tokens}; a cut-off answer usually scores 0: raise it"),
                        (m["groups/equal_frac"] == 1, "every group had equal rewards, so no learning signal: check "
                         "the reward on the table above (or --log-samples), or the task's difficulty"),
                        ("train/not_finite" in m, "the loss or gradient was not finite: the step was not applied")]:
                    if bad and msg not in warned:  # once per run, each
                        warned.add(msg)
                        bar.write(f"grpo: warning: step {step}: {msg}", sys.stderr)
                if a.wandb_project:
                    wandb.log(m, step=step)
                bar.set_postfix(reward=f"{m['reward/mean']:.3f}", acc=f"{m.get('accuracy', 0):.2f}")
                if (a.save_every and step % a.save_every == 0) or step == a.max_steps or stopping:
                    busy = "save"
                    save(model, tok, a, {**done, "optimizer": opt.state_dict()})
                    busy = ""
            if stopping:
                break
    except (Exception, SystemExit) as e:  # keep the last completed step, if there is a new one, the weights are
        if rank != 0 or done["step"] == start or busy == "save" or (busy == "train" and a.num_iterations > 1):
            raise  # not half-updated and this is not the save failing
        save(model, tok, a, {**done, "optimizer": opt.state_dict()})
        if isinstance(e, SystemExit):
            raise SystemExit(f"{e} (step {done['step']} saved in {where})") from None
        print(f"grpo: step {done['step']} saved in {where}", file=sys.stderr)
        raise
    finally:
        for f in filter(None, (log, samples, lock_file)):
            f.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    if rank == 0:
        print(f"grpo: stopped at step {done['step']} of {a.max_steps}: --resume to continue ({where})" if stop
              else f"grpo: step {done['step']} saved in {where}")
    if stop:  # preempted: the status a scheduler reads as "killed by that signal"
        raise SystemExit(128 + stop[0])


if __name__ == "__main__":
    main()
