"""grpo.py: GRPO and its descendants in one file, for fine-tuning language models on verifiable rewards.

    python grpo.py --algo drgrpo --model Qwen/Qwen2.5-0.5B-Instruct    # or grpo, dapo, drgrpo_soft
    python grpo.py --algo dapo --dry-run       # print the objective a preset optimises, then exit
    python grpo.py --resume --max-steps 400    # continue the run saved in --output-dir, bit for bit
    torchrun --nproc_per_node 4 grpo.py ...    # several GPUs: each rank takes whole groups

One step: B prompts -> G sampled completions each -> rewards -> what the terms read of pi_old and the
reference -> group-relative advantages -> clipped token loss -> optimizer steps. A preset sets defaults:
  grpo         GRPO (2402.03300) §4.1: A = (R - mean) / std; sequence token means, averaged; k3 KL 0.04
  drgrpo       Dr. GRPO (2503.20783) §3.1: no / std, no 1 / |o_i|: token sums / (n_seq T); no KL
  dapo         DAPO (2503.14476) §3: clip-higher 0.28, dynamic sampling, token-mean, overlong penalty, ±1
  drgrpo_soft  Dr. GRPO+ soft (no paper): Dr. GRPO's A times std_g / max std_g'; sequence token sums
Every other variant is a flag and one place (papers beside the code): the token loss, policy_loss:
--ratio sequence (GSPO; LUSPO), --surrogate cispo | sapo | gmpo | vespo | clip_cov | kl_cov, --dual-clip;
around it, token_objective: --beta/--kl, --tis(-mode), --opsm-delta, --entropy-coef; the rewards, advantage
and mask, step_terms: --kl-in-reward, --adv-estimator rloo | reinforce_plus_plus_baseline | gdpo, --scale
batch, --soft-reweight, --top-entropy-quantile, --mask-truncated. --dry-run prints what the flags add up to.
Mixed pool (--teacher-pool): G_s samples and G_t cached teacher completions with frozen rewards in one group
(as in LUFFY, 2504.14945); --split-grads backpropagates them apart. Tool calls: --tools; environments with
state (TRL's environment_factory): --env; a reward model: --reward-model. Departures: README.
Shapes: B prompts a step, G completions a prompt (G_s + G_t), N rows (B*G, or a micro-batch), P prompt
length (left padded), C completion length (<= T = max_new_tokens), H hidden size, V vocabulary.
"""
import argparse
import collections
import dataclasses
import decimal
import fcntl
import functools
import importlib.util
import inspect
import itertools
import json
import math
import numbers
import os
import pathlib
import random
import runpy
import shutil
import signal
import statistics
import sys
import tempfile
import textwrap
import time
import zlib
from contextlib import nullcontext, suppress

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from rewards import (MAX_ANSWER, REWARDS, calculator, is_correct, overlong_penalty, reference_answer,
                     reward_model)


def dash(name: str) -> str:
    return "--" + name.replace("_", "-")  # a flag as typed: max_new_tokens -> --max-new-tokens

def fail(msg: str):
    raise SystemExit(f"grpo: error: {msg}")

# ----------------------------------------------------------------------------- flags and presets
def flag(default, help, choices=(), bounds="[0, inf)", needs=""):
    """A flag: its default (also "off", whatever the bounds), help, choices, bounds, the flag it acts with."""
    return dataclasses.field(default=default, metadata=locals())  # its arguments: help, choices, ...

LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
PRESETS = {  # the papers' values
    "grpo": dict(scale="std", loss_agg="seq-mean-token-mean", eps_low=0.2, eps_high=0.2, beta=0.04),
    "drgrpo": dict(scale="none", loss_agg="seq-mean-token-sum-norm", eps_low=0.2, eps_high=0.2, beta=0.0),
    "dapo": dict(scale="std", loss_agg="token-mean", eps_low=0.2, eps_high=0.28, beta=0.0,
                 dynamic_sampling=True, overlong_penalty=True, rewards="correct_pm1"),
    "drgrpo_soft": dict(scale="none", loss_agg="seq-mean-token-sum", eps_low=0.2, eps_high=0.2, beta=0.0,
                        soft_reweight=True)}

@dataclasses.dataclass
class Args:
    algo: str = flag("grpo", "preset: sets defaults (PRESETS); explicit flags win", tuple(PRESETS))  # run
    model: str = flag("Qwen/Qwen2.5-0.5B-Instruct", "hub id or local directory")
    output_dir: str = flag("grpo_out", "checkpoint/ and metrics.jsonl go here")
    resume: str = flag("", "continue the run in --output-dir (auto: if it has one)", ("on", "auto"))
    overwrite: bool = flag(False, "start over in an --output-dir that holds a run, deleting it")
    max_steps: int = flag(200, "steps: a rollout, then num_iterations updates on it", bounds="(0, inf)")
    seed: int = flag(0, "seeds the data order, sampling (+1000 * rank) and the LoRA init", bounds="[0, 2e18]")
    dry_run: bool = flag(False, "print the objective the flags optimise and the flags, then exit")
    save_every: int = flag(50, "steps between checkpoints (0: only at the end)")
    wandb_project: str = flag("", "log to this wandb project too (needs wandb installed)")
    log_samples: int = flag(0, "groups a step written to samples.jsonl: texts, rewards, advantages")
    dataset: str = flag("", "JSONL (prompt/answer or GSM8K lines) or a NAME[:CONFIG][@SPLIT] dataset")  # data
    eval_dataset: str = flag("", "held-out prompts, as --dataset (split: test); '': built-in task's or none")
    max_samples: int = flag(0, "train on the first N examples only (0: all)")
    eval_every: int = flag(50, "steps between evaluations, also before the first and at the last (0: none)")
    eval_prompts: int = flag(64, "held-out prompts an evaluation", bounds="(0, inf)")
    eval_samples: int = flag(0, "k: also sample k completions a held-out prompt, for mean@k and pass@k")
    system_prompt: str = flag("Please reason step by step, and put your final answer within \\boxed{}.",
                              "system message of the chat template ('' for none)")
    prompts_per_step: int = flag(8, "B: prompts (groups) a step, all ranks", bounds="(0, inf)")  # generate
    num_generations: int = flag(8, "G_s: sampled completions a prompt", bounds="(0, inf)")
    max_new_tokens: int = flag(256, "T: completion length cap (Dr. GRPO's normaliser)", bounds="(0, inf)")
    temperature: float = flag(1.0, "sampling temperature", bounds="(0, inf)")
    top_p: float = flag(1.0, "nucleus sampling (1: off)", bounds="(0, 1]")
    top_k: int = flag(0, "top-k sampling (0: off)")
    compile_generate: str = flag("auto", "compiled sampler (auto: with CUDA)", ("auto", "on", "off"))
    tools: str = flag("", "tools the model may call: calculator, PATH.py (its public functions), PATH.py:f,g")
    env: str = flag("", "PATH.py:Class: an instance a completion, reset(**record), its methods the tools")
    max_tool_calls: int = flag(8, "tool calls a completion at most (--tools, --env)")
    tool_timeout: float = flag(10.0, "seconds a call may run, then its process is killed", bounds="(0, 1e6]")
    rewards: str = flag("correct", "built-in rewards, weighted: correct:1,format:0.2 (rewards.py)")  # reward
    reward_fn: str = flag("", "your own reward, PATH.py:FUNCTION; used alone unless --rewards is given")
    reward_model: str = flag("", "a reward model: a sequence classifier (ID or PATH), --rewards' model:W")
    overlong_penalty: bool = flag(False, "DAPO §3.4 soft overlong punishment added to the reward")
    overlong_buffer: int = flag(0, "the penalty's L_cache in tokens (0: T // 5)", needs="overlong_penalty")
    kl_in_reward: float = flag(0.0, "β: R_i -= β Σ_t log π_old/π_ref before the advantage (RLOO's KL)")
    kl_target: float = flag(0.0, "adaptive β: moved to this KL a token (verl kl_ctrl)", needs="kl_in_reward")
    adv_estimator: str = flag("grpo", "grpo | rloo | reinforce_plus_plus_baseline | gdpo (verl's names)",
                              ("grpo", "rloo", "reinforce_plus_plus_baseline", "gdpo"))  # advantage
    scale: str = flag("std", "divides R - mean_g", ("std", "none", "batch"), needs="adv_estimator grpo")
    std_eps: float = flag(1e-6, "eps in the std scaling and in the soft weights", bounds="(0, inf)")
    soft_reweight: bool = flag(False, "Dr. GRPO+ soft: A *= std_g / max std over the step's groups")
    dynamic_sampling: bool = flag(False, "DAPO §3.2: keep groups of unequal rewards, sample again to refill")
    max_gen_rounds: int = flag(4, "max sampling rounds a step", bounds="(0, inf)", needs="dynamic_sampling")
    top_k_groups: int = flag(0, "keep the k groups with the largest reward std (0: off)")
    skip_zero_variance: bool = flag(True, "no forward/backward of equal-reward groups, if it changes nothing")
    top_entropy_quantile: float = flag(1.0, "ρ: only top-ρ tokens by H train (80/20: 0.2)", bounds="(0, 1]")
    loss_agg: str = flag("seq-mean-token-mean", "token losses to one number", LOSS_AGGS)  # loss
    eps_low: float = flag(0.2, "ratio clipped below at 1 - eps_low", bounds="[0, 1)")
    eps_high: float = flag(0.2, "ratio clipped above at 1 + eps_high (DAPO clip-higher: 0.28)")
    ratio: str = flag("token", "token: pi / pi_old | sequence: GSPO's", ("token", "sequence"))
    surrogate: str = flag("clip", "the token loss (policy_loss); gmpo's eps bound log r (paper: 0.4)",
                          ("clip", "cispo", "sapo", "gmpo", "vespo", "clip_cov", "kl_cov"))
    sapo_tau_pos: float = flag(1.0, "τ if A > 0: larger, harder", bounds="(0, inf)", needs="surrogate sapo")
    sapo_tau_neg: float = flag(1.05, "τ if A < 0: above τ_pos", bounds="(0, inf)", needs="surrogate sapo")
    dual_clip: float = flag(0.0, "c: loss at most c|A| if A < 0", bounds="(1, inf)", needs="surrogate clip")
    cov_ratio: float = flag(2e-4, "share held back", bounds="(0, 1]", needs="surrogate clip_cov kl_cov")
    cov_low: float = flag(1.0, "draws cov(A, log π) > it", bounds="(-inf, inf)", needs="surrogate clip_cov")
    cov_high: float = flag(5.0, "draws cov(A, log π) < it", bounds="(-inf, inf)", needs="surrogate clip_cov")
    cov_kl_coef: float = flag(0.1, "|log r|'s weight on the top-cov tokens (verl)", needs="surrogate kl_cov")
    opsm_delta: float = flag(math.inf, "δ: no loss where A < 0 and mean log π_sampler/π > δ (TRL 0.5)")
    beta: float = flag(0.0, "KL weight against the reference (the adapter disabled)")
    kl: str = flag("k3", "KL term (kl_penalty)", ("k3", "k3_ratio", "k2"), needs="beta")
    mask_truncated: bool = flag(False, "DAPO §3.4 overlong filtering: no loss on completions without EOS")
    tis: float = flag(0.0, "C: loss × w = π_old/π_sampler ≤ C (TRL: 3; IcePop: 5)", bounds="[1, inf)")
    tis_mode: str = flag("token_truncate", "w a token or o_i's product; clamped, or 0 outside (IcePop: mask)",
                         ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"), needs="tis")
    tis_min: float = flag(0.0, "w's floor: clamped or masked under (IcePop .5)", bounds="[0, 1)", needs="tis")
    entropy_coef: float = flag(0.0, "c: loss -= c H, the entropy bonus, aggregated as the loss")
    num_iterations: int = flag(1, "updates a step (if > 1, old_logp computed once)", bounds="(0, inf)")
    teacher_pool: str = flag("", "JSONL lines: prompt, teacher completion, reward", needs="teacher_per_group")
    teacher_per_group: int = flag(0, "G_t: teacher completions a group, beside G_s", needs="teacher_pool")
    split_grads: bool = flag(False, "student, teacher halves apart: |g_s|, |g_t|, cos", needs="teacher_pool")
    lora_r: int = flag(16, "LoRA rank (0: full fine-tuning)")  # model and optimizer
    lora_alpha: int = flag(32, "LoRA alpha", bounds="(0, inf)")
    lora_dropout: float = flag(0.0, "LoRA dropout (0: logp the same in every pass)", bounds="[0, 1)")
    load_in_4bit: bool = flag(False, "QLoRA: 4-bit NF4 base weights (bitsandbytes)")
    dtype: str = flag("auto", "auto: bf16 where supported, else fp32", ("auto", "bf16", "fp32"))
    gradient_checkpointing: bool = flag(False, "recompute activations in backward")
    micro_batch_size: int = flag(8, "rows a forward/backward (gradient accumulation)", bounds="(0, inf)")
    optim: str = flag("adamw_torch", "AdamW's", ("adamw_torch", "adamw_8bit", "paged_adamw_8bit"))
    learning_rate: float = flag(2e-5, "AdamW learning rate", bounds="(0, inf)")
    warmup_steps: int = flag(0, "linear warm-up of the learning rate over N steps (DAPO: 20)")
    weight_decay: float = flag(0.0, "AdamW weight decay")
    max_grad_norm: float = flag(1.0, "clip the gradient norm (0: no clipping)")

PATHS = ("model", "dataset", "eval_dataset", "reward_fn", "reward_model", "teacher_pool", "tools", "env")
RESUMABLE = {"resume", "overwrite", "output_dir", "max_steps", "save_every", "eval_every", "eval_prompts",
             "eval_samples", "log_samples", "wandb_project", "compile_generate", "dry_run", *PATHS,
             "micro_batch_size", "gradient_checkpointing"}  # memory only (clip_cov, kl_cov: per micro-batch)

def parse_args(argv=None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], argument_default=argparse.SUPPRESS)
    for f in dataclasses.fields(Args):
        kind = dict(action=argparse.BooleanOptionalAction) if f.type is bool else dict(type=f.type)
        if f.name == "resume":  # --resume, or --resume auto
            kind = dict(nargs="?", const="on")
        parser.add_argument(dash(f.name), help=f"{f.metadata['help']} [{f.default!r}]",
                            choices=f.metadata["choices"] or None, **kind)
    given = vars(parser.parse_args(argv))
    defaults = PRESETS[given.get("algo", Args.algo)]  # a preset is defaults; an explicit flag wins
    saved = {}  # the checkpoint's grpo_args.json, on --resume
    out = given.get("output_dir", Args.output_dir)
    rank = setup_distributed()[0]  # (under torchrun, the process group is made here: rank 0 reads the dir)
    if rank == 0 and out and not given.get("dry_run"):  # one run per dir, from before anything in it is read
        lock_output(out, wait=bool(given.get("resume")))  # --resume waits: a live run may be saving
    ckpt = last_checkpoint(out, resume=given["resume"]) if rank == 0 and given.get("resume") else None
    if given.get("resume"):  # every rank acts on rank 0's reading: continue (auto: start if no save was made)
        ckpt = all_gather(ckpt)[0]
        given.update(resume="on" if ckpt else "", overwrite=given.get("overwrite", False) or not ckpt)
    if given.get("resume"):  # the saved run's flags are the defaults
        saved = json.loads(pathlib.Path(ckpt, "grpo_args.json").read_text())
        defaults = {k: v for k, v in saved.items() if k in Args.__dataclass_fields__ and k != "overwrite"}
        for k, v in given.items():
            was = defaults.get(k, getattr(Args, k))  # a flag newer than the checkpoint: its default
            if k not in RESUMABLE and was != v:
                fail(f"--resume: {dash(k)} is {v!r} here but {was!r} in the saved run: drop the flag "
                     f"to continue that run, or start a new one in another --output-dir")
    elif given.get("reward_fn") and "rewards" not in given:
        defaults = {**defaults, "rewards": ""}  # a custom reward alone, unless --rewards names built-ins too
    a = Args(**{**defaults, **given})
    if a.overlong_penalty and a.overlong_buffer == 0:  # derived values
        a.overlong_buffer = max(1, a.max_new_tokens // 5)
    if a.output_dir:  # absolute: a reward that changes the working directory moves nothing
        a.output_dir = os.path.abspath(a.output_dir)
    for name in PATHS:  # saved absolute, so that --resume works from any directory
        path, rest = split_path(getattr(a, name))
        local = path.startswith(("/", ".", "~")) or os.path.isdir(os.path.dirname(path))  # not a hub id
        if path and os.path.exists(path):
            setattr(a, name, os.path.abspath(path) + rest)
        elif local or path.endswith((".py", ".jsonl", ".json", ".csv", ".parquet")):  # (--dry-run's too)
            fail(f"{dash(name)} {getattr(a, name)!r}: no such file or directory")
        was, was_rest = split_path(saved.get(name, getattr(a, name)))  # the saved run's, on --resume
        if (bool(was), was_rest) != (bool(path), rest):  # a path added or dropped, other :FUNCTION, @SPLIT
            fail(f"--resume: {dash(name)} is {getattr(a, name)!r} here but {saved[name]!r} in the saved run: "
                 f"a path may move, but name the same thing")
        if name in saved.get("files", {}) and saved["files"][name] != fingerprint(path):  # paths may move
            if name == "model":
                fail(f"--resume: --model {a.model!r} is not the model the run started from (its config or "
                     f"weights differ, or it is not there): give that model, or start a new run")
            print(f"grpo: note: the {dash(name)} file has changed since the run was saved", file=sys.stderr)
    check_args(a, given)
    return a

def split_path(value: str) -> tuple[str, str]:  # PATH.py:FUNCTION, DIR[:CONFIG][@SPLIT] -> the path, the rest
    cuts = [i for i, c in enumerate(value) if c in ":@"] + [len(value)]
    for i in reversed(cuts):  # the longest that exists: a path may hold ':' or '@' itself
        if os.path.exists(value[:i]):
            return value[:i], value[i:]
    return value[:cuts[0]], value[cuts[0]:]  # (a hub id, or not there)

def within(value, bounds: str) -> bool:  # bounds: an interval as written, "[0, 1)"
    low, high = (float(x) for x in bounds[1:-1].split(","))
    above = value >= low if bounds[0] == "[" else value > low
    return above and (value <= high if bounds[-1] == "]" else value < high)

def check_args(a: Args, typed=()):
    """Each flag against its declaration (flag; `typed`: not a preset's or saved run's), then among flags."""
    for f in dataclasses.fields(a):
        value = getattr(a, f.name)
        if type(value) in (int, float) and value != f.default and not within(value, f.metadata["bounds"]):
            fail(f"{dash(f.name)} must be in {f.metadata['bounds']}, not {value}")
        on, *values = f.metadata["needs"].split() or [None]  # on: "tis" off its default, "surrogate sapo" at
        off = on and (str(getattr(a, on)) not in values if values else getattr(a, on) == getattr(Args, on))
        if f.name in typed and off:
            needs = " or ".join(f"{dash(on)} {v}" for v in values) or dash(on)
            fail(f"{dash(f.name)} does nothing without {needs}: add it, or drop {dash(f.name)}")
    checks = [
        (not a.output_dir, "--output-dir must name a directory"),
        (group_size(a) < 2, "a group needs 2 completions: raise --num-generations"),
        (a.resume and a.overwrite, "--resume continues the run, --overwrite deletes it: give one"),
        (a.load_in_4bit and a.lora_r == 0, "--load-in-4bit trains LoRA adapters: set --lora-r > 0"),
        (a.top_k_groups > a.prompts_per_step, "--top-k-groups must be at most --prompts-per-step"),
        (a.overlong_buffer > a.max_new_tokens, "--overlong-buffer must be at most --max-new-tokens (L_max)"),
        (a.adv_estimator == "gdpo" and (a.teacher_pool or a.kl_in_reward), "--adv-estimator gdpo normalises "
         "each reward function apart: the pool's rewards and --kl-in-reward have no parts: drop them"),
        (a.surrogate in ("gmpo", "vespo") and a.ratio == "sequence", "--surrogate gmpo and vespo take token "
         "ratios (their own mean and product over o_i): drop --ratio sequence"),
        (a.surrogate == "clip_cov" and a.cov_low >= a.cov_high, "--cov-low must be below --cov-high"),
        (a.dataset == a.eval_dataset == "" and a.eval_prompts > HELD_OUT, f"--eval-prompts: the built-in "
         f"task has {HELD_OUT}"),
        (a.dataset and not a.eval_dataset and any(getattr(a, k) for k in typed if k.startswith("eval_")),
         "--eval-every, --eval-prompts and --eval-samples do nothing without --eval-dataset: add it"),
        (a.tools and a.env, "--tools and --env: give one (an environment's public methods are its tools)"),
        (not (a.tools or a.env) and {"max_tool_calls", "tool_timeout"} & set(typed), "--max-tool-calls and "
         "--tool-timeout do nothing without --tools or --env: add one, or drop them"),
        (not a.rewards.strip(", ") and not a.reward_fn, "no reward: give --rewards and/or --reward-fn"),
        (a.wandb_project and not importlib.util.find_spec("wandb"), "--wandb-project: `pip install wandb`")]
    for bad, msg in checks:
        if bad:
            fail(msg)

# ----------------------------------------------------------------------------- data
HELD_OUT = 2900  # problems the built-in task holds out: about one in four of its 11,803

def arithmetic_task(n: int, seed: int, held_out: bool = False) -> list[dict]:
    """The built-in verifiable task: n seeded one-step arithmetic word problems. One problem in four (its
    operation and numbers, in any wording) is held out, by a hash of itself, whatever the flags."""
    rng = random.Random(seed)
    out = []
    seen = set()
    while len(out) < n:
        who = rng.choice(["Ava", "Ben", "Chen", "Dana", "Eli", "Fatima", "Gus", "Hana"])
        what = rng.choice(["apples", "pens", "coins", "cards"])
        kind = rng.randrange(4)  # +, -, *, /
        a = rng.randint(2, 12 if kind >= 2 else 99)
        b = rng.randint(2, 99)
        problem = (kind, a * b, a) if kind == 3 else (kind, min(a, b), max(a, b))
        if (zlib.crc32(repr(problem).encode()) % 4 == 0) != held_out or problem in seen:
            continue
        if held_out:  # each held-out problem once
            seen.add(problem)
        question = [f"{who} has {a} {what} and gets {b} more. How many {what} does {who} have now?",
                    f"{who} has {max(a, b)} {what} and gives away {min(a, b)}. How many {what} are left?",
                    f"{who} buys {a} boxes with {b} {what} in each. How many {what} is that?",
                    f"{who} shares {a * b} {what} equally among {a} friends. How many does each get?"][kind]
        out.append({"prompt": question, "answer": str([a + b, abs(a - b), a * b, b][kind])})
    return out

def read_records(source: str, split: str) -> list[tuple[str, dict]]:
    """(where, record): a JSONL file's lines, else rows through `datasets`: a .parquet, .csv or .json file's,
    or those of NAME[:CONFIG][@SPLIT], a hub id or a local directory."""
    path, rest = split_path(source)
    kind = {".parquet": "parquet", ".csv": "csv", ".json": "json"}.get(os.path.splitext(path)[1].lower())
    if not kind and not rest and (os.path.isfile(path) or path.endswith(".jsonl")):
        try:
            lines = pathlib.Path(source).read_bytes().splitlines()
        except OSError as e:
            fail(f"{source}: {e.strerror}")
        rows = []
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rows.append((f"{source}:{i}", {**json.loads(line)}))
                json.dumps(rows[-1][1], ensure_ascii=False).encode()  # a lone surrogate fails at a tokenizer
            except UnicodeEncodeError as e:
                fail(f"{source}:{i}: {e.object[e.start:e.end]!a} is half a surrogate pair, not text: escape "
                     f"both halves of the pair, or neither")
            except (ValueError, TypeError) as e:  # not JSON, or JSON but not an object
                fail(f"{source}:{i}: not a JSON object ({e}); JSONL is one JSON object a line")
    else:
        config, _, named = rest.partition("@")  # ':CONFIG', 'SPLIT'
        split = named or split
        try:
            from datasets import get_dataset_config_names, load_dataset
            if kind or os.path.isfile(path):  # a local file: its rows are the one split `datasets` makes
                split = named or "train"
                rows = load_dataset(kind or "json", data_files=path, split=split)
            else:
                rows = load_dataset(path, config[1:] or get_dataset_config_names(path)[0], split=split)
            if "float" in str(rows.features.get("answer")):  # numpy's numbers: a float32 column's in float32
                rows = rows.with_format("numpy", columns=["answer"], output_all_columns=True)
        except ImportError as e:  # `datasets`, or a package it needs for this one
            fail(f"{source} is not a JSONL file: a dataset needs `pip install datasets` ({e})")
        except Exception as e:  # not found, offline, no such config or split: what `datasets` says, one line
            empty = "corresponds to no data" in str(e) or os.path.isfile(path) and not os.path.getsize(path)
            fail(f"{source}: no examples" if empty else f"{path}{config}@{split}: {' '.join(str(e).split())}")
        rows = [(f"{path}{config}@{split}:{i}", rec) for i, rec in enumerate(rows, 1)]
    if not rows:
        fail(f"{source}: no examples")
    return rows

def load_examples(source: str, split: str, graded: bool, reward_fns=(), keywords: dict = {}) -> list[dict]:
    """prompt/answer records or GSM8K's question/answer ('... #### N'); graded: a reward reads the answer."""
    out = []
    for where, rec in read_records(source, split):
        prompt = rec.get("question", rec.get("prompt"))
        answer = rec.get("answer")
        given = isinstance(answer, (str, numbers.Real, decimal.Decimal)) and not isinstance(answer, bool)
        if given and not isinstance(answer, str):  # a number: finite, and as the shortest text that reads
            given = decimal.Decimal(str(answer)).is_finite()  # back as it in its own precision, as str() of
            answer = format(decimal.Decimal(str(answer)), "f")  # Python's and numpy's: 0.00005, float32's 0.1
        answer = reference_answer(str(answer))  # graded: it is read, so not empty, not '####'
        bad = not given or graded and (not answer or "####" in answer)  # (nothing equals a NaN, JSON's 1e400)
        t = rec.get("temperature", 1)  # its prompt's sampling temperature, if it gives one
        if not isinstance(prompt, str) or not prompt.strip() or bad or not (finite32(t) and t > 0):
            fail(f"{where}: each line needs a prompt (or GSM8K's question) and an answer (a string or a "
                 f"finite number; GSM8K's: '... #### N'), neither empty; a temperature, if any, above 0")
        out.append({**rec, "prompt": prompt, "answer": answer})
        fields = {k: v for k, v in out[-1].items() if k != "answer"}
        for name, fn, _ in reward_fns:  # bound as score() will call it: a field a reward needs is here
            try:  # a keyword-only parameter with a default is the reward's own
                kw = {**(inspect.getfullargspec(fn).kwonlydefaults or {}), **keywords}
                inspect.signature(fn).bind(answer, answer, **fields, **kw)
            except TypeError as e:  # a keyword the reward requires and the record lacks, or the reverse
                fail(f"{where}: reward {name!r} cannot take this record's fields and length, max_length: {e}")
    return out

def load_data(a: Args, reward_fns=()) -> tuple[list[dict], list[dict]]:
    graded = any(getattr(fn, "reads_answer", False) for _, fn, _ in reward_fns)  # rewards.reads_answer
    evals = load_examples(a.eval_dataset, "test", graded) if a.eval_dataset else []  # (no reward sees them)
    if a.dataset == "":
        train = arithmetic_task(20000, a.seed)
        evals = evals or arithmetic_task(a.eval_prompts, 0, held_out=True)
    else:
        train = load_examples(a.dataset, "train", graded, reward_fns, reward_keywords(a))
    unread = [ex["answer"] for ex in train + evals if "\n" in ex["answer"] or len(ex["answer"]) > MAX_ANSWER]
    if graded and unread:  # a worked solution (GSM8K's without '#### N'): `correct` compares final answers
        fail(f"{len(unread)} answers `correct` cannot read, e.g. {unread[0][:40]!r}: end each in '#### N'")
    return train[:a.max_samples or None], evals[:a.eval_prompts]

def finite32(x) -> bool:  # a reward: a real number that float32 holds (a Python int may not even fit a float)
    return isinstance(x, numbers.Real) and abs(x) <= torch.finfo(torch.float32).max

def load_teacher_pool(a: Args, train: list[dict], tok) -> dict[str, list[tuple[str, torch.Tensor, float]]]:
    pool = {}  # prompt -> [(completion, its tokens as the policy would emit them: text + EOS, frozen reward)]
    for where, r in read_records(a.teacher_pool, "train"):
        ok = isinstance(r.get("prompt"), str) and isinstance(r.get("completion"), str) and r["completion"]
        if not ok or not finite32(r.get("reward")):
            fail(f"{where}: each line needs a prompt, a completion and a reward, a number finite in float32")
        ids = tok(r["completion"], add_special_tokens=False).input_ids + [tok.eos_token_id]
        pool.setdefault(r["prompt"], []).append((r["completion"], torch.tensor(ids), float(r["reward"])))
    short = [ex["prompt"] for ex in train if len(pool.get(ex["prompt"], [])) < a.teacher_per_group]
    if short:
        fail(f"{len(set(short))} training prompts have fewer than --teacher-per-group {a.teacher_per_group} "
             f"completions in the pool, e.g. {short[0][:60]!r}: add them, or lower --teacher-per-group")
    trained = {ex["prompt"] for ex in train}
    long = [len(ids) for p in trained for _, ids, _ in pool[p] if len(ids) > a.max_new_tokens]
    if long:  # cut at T, a completion would keep the reward graded on its whole text
        fail(f"--teacher-pool: {len(long)} completions are longer than --max-new-tokens {a.max_new_tokens} "
             f"tokens with their EOS (the longest: {max(long)}): raise --max-new-tokens, or drop them")
    return pool

def prompt_stream(data: list[dict], seed: int):  # endless; every rank draws the same order
    rng = random.Random(seed)
    while True:
        order = list(range(len(data)))
        rng.shuffle(order)
        yield from (data[i] for i in order)

# ----------------------------------------------------------------------------- model
def load_model(a: Args, device: torch.device, resume: str | None = None):
    """Policy (LoRA, QLoRA or full), tokenizer, a frozen reference (full fine-tuning with KL); resume: a
    checkpoint whose adapter (or whole model) replaces the fresh one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, GenerationConfig
    # LoRA: bf16 base weights when bf16 is on; full fine-tuning keeps fp32 weights, in bf16 autocast
    dtype = torch.bfloat16 if use_bf16(a, device) and a.lora_r > 0 else torch.float32
    kw = dict(dtype=dtype, device_map={"": device})
    if a.load_in_4bit:
        kw["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                       bnb_4bit_use_double_quant=True,
                                                       bnb_4bit_compute_dtype=dtype)
    try:
        tok = AutoTokenizer.from_pretrained(resume or a.model)  # resume: the run's own chat template and EOS
        model = AutoModelForCausalLM.from_pretrained(resume if resume and a.lora_r == 0 else a.model, **kw)
    except (OSError, ValueError) as e:  # no weights in the directory; not on the hub (or no network)
        fail(f"--model {a.model!r}: {str(e).splitlines()[0]}")
    tok.padding_side = "left"  # batched generation appends to the right end of every row
    tok.pad_token = tok.pad_token or tok.eos_token  # safe: completions are masked by position, not by id
    for m in model.modules():  # bitsandbytes on CPU repacks 4-bit weights in eval mode; training then fails
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    # a contiguous input to the output layer: a CPU bf16 matmul copies the weight a row for a strided one
    model.get_output_embeddings().register_forward_pre_hook(lambda _, args: (args[0].contiguous(), *args[1:]))
    eos = model.generation_config.eos_token_id  # chat models may end on several tokens
    eos = sorted({tok.eos_token_id, *(eos if isinstance(eos, list) else [eos] if eos is not None else [])})
    # sample the policy itself: none of the checkpoint's generation defaults but its EOS ids
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id)
    if a.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref_model = None
    if a.lora_r > 0:
        import peft
        if a.load_in_4bit:
            model = peft.prepare_model_for_kbit_training(model, a.gradient_checkpointing)
        config = peft.LoraConfig(r=a.lora_r, lora_alpha=a.lora_alpha, lora_dropout=a.lora_dropout,
                                 target_modules="all-linear", task_type="CAUSAL_LM")
        model = peft.get_peft_model(model, config)
        if resume:
            model.load_adapter(resume, "default", is_trainable=True)
    elif {"ref_logp", "ref_entropy"} & probe(a)[0]:  # full fine-tuning, and a term reads the reference:
        ref_model = AutoModelForCausalLM.from_pretrained(a.model, **kw).eval().requires_grad_(False)  # a copy
    return model.train(), tok, ref_model  # (from_pretrained gives eval mode: no checkpointing, no dropout)

def use_bf16(a: Args, device: torch.device) -> bool:
    return a.dtype == "bf16" or a.dtype == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported()

def autocast(a: Args, device: torch.device):
    return torch.autocast(device.type, torch.bfloat16, enabled=a.lora_r == 0 and use_bf16(a, device))

def make_optimizer(a: Args, model):
    params = [p for p in model.parameters() if p.requires_grad]  # only what trains reaches the optimizer
    if a.optim == "adamw_torch":
        return torch.optim.AdamW(params, lr=a.learning_rate, weight_decay=a.weight_decay)
    import bitsandbytes as bnb
    optimizer = bnb.optim.AdamW8bit if a.optim == "adamw_8bit" else bnb.optim.PagedAdamW8bit
    return optimizer(params, lr=a.learning_rate, weight_decay=a.weight_decay)

# ----------------------------------------------------------------------------- generate
# A step: at_step (its flags) -> rollout: draw B prompts, generate G_s rows each (a row: a completion, its
# record; G_t from the pool), score, select_groups -> train_step: prepare (collate; step_inputs: what probe
# finds the terms read; gather_step: all ranks' rows as one process has them, `mine` this rank's; step_terms:
# R, A, the loss mask) -> per micro-batch token_objective, aggregate_loss, backward -> gradients summed over
# ranks -> the update -> step_stats. A term reads inputs by name (b["ref_logp"]); its memory: state.
def at_step(a: Args, state: dict, step: int) -> Args:
    """The flags step `step` uses: the sampler, rewards, terms, optimizer and evaluation read this copy, one
    value for all. state: the run's memory, saved for --resume: step, max_steps (the first run's, so that
    --max-steps N moves no schedule: clamp one past it), prompts_drawn, scored, a term's. FORKER: a schedule
    (temperature, top-p, top-k, T <= --max-new-tokens, a coefficient) is a keyword here, as the lr's."""
    state["step"] = step
    return dataclasses.replace(a, learning_rate=a.learning_rate * min(1, step / max(1, a.warmup_steps)))

def chat_prompt(tok, prompt: str, system: str, tools: dict | None = None, reply: str | None = None) -> str:
    if not tok.chat_template:
        return prompt + (reply or "")
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    messages += [{"role": "assistant", "content": reply}] if reply is not None else []  # a reward model reads
    shown = tools and tools["schemas"]  # --tools: the schemas, as the model was trained to read them
    return tok.apply_chat_template(messages, tools=shown, tokenize=False, add_generation_prompt=reply is None)

def prompt_text(tok, ex: dict, a: Args, tools=None, reply=None) -> str:  # sampled, evaluated, --reward-model
    return chat_prompt(tok, ex["prompt"], a.system_prompt, tools, reply)  # FORKER: a record's system prompt

def completion_mask(ids: torch.Tensor, eos_ids) -> torch.Tensor:
    """ids (N, C) -> mask (N, C): 1 up to and including the first EOS (an action to learn), 0 after."""
    is_eos = torch.isin(ids, torch.as_tensor(eos_ids, device=ids.device))  # by position: pad may be an EOS
    return is_eos.cumsum(1) - is_eos.int() == 0  # no EOS before it

def generate(model, tok, rows: list[dict], a: Args, greedy=False, sampler=None, tools=None) -> list[dict]:
    """Each row's completion, to EOS or T tokens in all; --tools, --env: a turn that ends in calls gets their
    results and draws on, till the episode ends. A row, {"record": its prompt's}, gets prompt_ids (--env: the
    text its reset returns ends the user turn), completion, logp (the sampler's), tool_mask (0 on a result),
    tool_calls, truncated (not ended by the model's EOS), text (the model's tokens, graded), env (--env)."""
    eos = model.generation_config.eos_token_id
    temps = [r["record"].get("temperature", a.temperature) for r in rows]  # FORKER: a prompt's, set in draw
    for bad in (t for t in temps if not (finite32(t) and t > 0)):  # (a record's field: rewards get it too)
        fail(f"a record's temperature must be a number above 0, not {bad!r}")
    for i, r in enumerate(rows):  # --env: the row's instance, reset with its record (a tools file's: no-op)
        start = run_tool(tools, {"name": "reset"}, i, r)["result"] if tools else ""
        text = prompt_text(tok, {**r["record"], "prompt": r["record"]["prompt"] + start}, a, tools)
        r.update(prompt_ids=torch.tensor(tok(text, add_special_tokens=not tok.chat_template).input_ids),
                 tool_calls=[])
    pieces = [[] for _ in rows]  # a row's (tokens, sampler log-probs, tool mask), in order
    todo = list(range(len(rows)))  # the rows still drawing
    while todo:
        held = [torch.cat([rows[i]["prompt_ids"]] + [ids for ids, _, _ in pieces[i]]) for i in todo]
        room = [a.max_new_tokens - len(h) + len(rows[i]["prompt_ids"]) for i, h in zip(todo, held)]  # T's
        drawn, logp = sample(model, tok, held, max(room), a, greedy, sampler, [temps[i] for i in todo])
        going = []
        for i, ids, lp, m, left in zip(todo, drawn, logp, completion_mask(drawn, eos), room):
            turn, calls = ids[m][:left], rows[i]["tool_calls"]  # up to its first EOS, within T
            pieces[i].append((turn, lp[m][:left], torch.ones(len(turn))))
            found = parse_tool_calls(tok.decode(turn)) if tools and turn[-1].item() in eos else []
            if len(calls) + len(found) > a.max_tool_calls:  # counted (metrics, rewards), not run
                calls += [{**c, "result": "error: past --max-tool-calls", "error": True} for c in found]
            if not found or len(calls) > a.max_tool_calls or len(turn) == left:
                continue  # the completion ends with this turn
            calls += [run_tool(tools, call, i, rows[i]) for call in found]
            if any(c.get("done") for c in calls[-len(found):]):
                continue  # the environment ended the episode
            result = torch.tensor(tool_turn(tok, eos, calls[-len(found):], left - len(turn)))
            pieces[i].append((result, torch.full(result.shape, math.nan), torch.zeros(len(result))))
            if len(turn) + len(result) < left:
                going.append(i)
        todo = going
    for r, p in zip(rows, pieces):
        r["completion"], r["logp"], r["tool_mask"] = (torch.cat([piece[k] for piece in p]) for k in range(3))
        r["truncated"] = r["completion"][-1].item() not in eos or not r["tool_mask"][-1]  # (0: a result cut)
        r["text"] = tok.decode(r["completion"][r["tool_mask"] > 0], skip_special_tokens=True)  # no tool's
    return rows

def sample(model, tok, held: list[torch.Tensor], new_tokens: int, a: Args, greedy=False, sampler=None,
           temps=None):
    """A turn of each row: the tokens drawn after what it holds (prompt, draws, results), their log-probs at
    the row's temperature (temps (n,)): a prefill, then a decode_step a token on the static KV cache."""
    if not sampler or len(held) > sampler["rows"] or max(map(len, held)) > sampler["prompt_len"]:
        sampler = make_sampler(model, a, max(map(len, held)), len(held))  # uncompiled, this call's shape
    N, P, n, dev = sampler["rows"], sampler["prompt_len"], len(held), model.device
    enc = tok.pad({"input_ids": held + [held[0][:0]] * (N - n)}, padding="max_length", max_length=P,
                  return_tensors="pt").to(dev)  # (N, P), left-padded; rows past n pad the shape, dropped
    pads = P - enc.attention_mask.sum(1, keepdim=True)  # (N, 1)
    temp = torch.full((N, 1), a.temperature, device=dev)  # FORKER: a row's own temperature comes in temps
    temp[:n, 0] = torch.as_tensor(temps if temps is not None else a.temperature) * (not greedy)  # 0: greedy
    eos = torch.tensor(model.generation_config.eos_token_id, device=dev)
    out = torch.zeros(N, new_tokens, dtype=torch.long, device=dev)  # (N, C): the tokens drawn
    logp = torch.zeros(N, new_tokens, device=dev)  # (N, C): their log-probs
    sampler["cache"].reset()  # zeros in place: a compiled step reads and writes one set of tensors
    model.eval()
    with torch.no_grad(), autocast(a, dev):
        x, pos, step = enc.input_ids, torch.arange(P, device=dev), decode_step  # the prefill: never compiled
        for t in range(new_tokens):
            out[:, t], logp[:, t] = step(model, sampler["cache"], x, pos, pads, temp, a.top_k, a.top_p)
            if t % 16 == 15 and torch.isin(out[:n, :t + 1], eos).any(1).all():  # the loop's one sync
                break
            x, pos, step = out[:, t:t + 1].contiguous(), pos[-1:] + 1, sampler["step"]  # (strides: guarded)
    model.train()
    if not logp[:, :t + 1].isfinite().all():  # (a drawn token's: a -inf logit is never drawn)
        fail("the model's logits are not finite: training diverged; lower --learning-rate")
    return out[:n, :t + 1].cpu(), logp[:n, :t + 1].cpu()  # (n, C) each

def decode_step(model, cache, ids, pos, pads, temp, top_k: int, top_p: float):
    """The rows' newest tokens ids (N, q) at cache positions pos (q,) into the cache -> the next token (N,),
    its log-prob at the row's temperature temp (N, 1; 0: greedy, at 1) before top-k/p (the trainer's)."""
    from transformers import TopKLogitsWarper, TopPLogitsWarper
    keys = torch.arange(cache.get_max_length(), device=ids.device)  # (L,): the cache's positions
    first = torch.minimum(pads[..., None], pos[:, None])  # (N, q, 1): the row's first token (a pad: itself)
    seen = (keys >= first) & (keys <= pos[:, None])  # (N, q, L): causal, past the left padding
    dtype = model.get_input_embeddings().weight.dtype
    mask = torch.where(seen[:, None], 0.0, torch.finfo(dtype).min).to(dtype)  # (N, 1, q, L), added
    hidden = model.get_decoder()(ids, mask, (pos - pads).clamp(min=0), cache,  # (by place: 5.24 renames it)
                                 use_cache=True).last_hidden_state[:, -1]  # (N, H): the last position's
    logits = model.get_output_embeddings()(hidden).float()  # (N, V)
    scores = logits / torch.where(temp > 0, temp, 1.0)
    logp = scores.log_softmax(-1)
    if top_k:  # transformers' own, in generate's order
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    drawn = (scores.softmax(-1) / torch.empty_like(scores).exponential_()).argmax(-1)  # ~ softmax, no sync
    token = torch.where(temp[:, 0] > 0, drawn, logits.argmax(-1))  # (N,)
    return token, logp.gather(-1, token[:, None])[:, 0]

def longest_prompt(model, tok, a: Args, train, evals, every: bool, tools=None) -> int:  # of those it reads
    room = (getattr(model.config, "max_position_embeddings", None) or math.inf) - a.max_new_tokens
    # a token is a byte or more, but for a BOS, an EOS and a space mark: room - bound bytes or fewer fit
    bound = len(prompt_text(tok, {"prompt": ""}, a, tools).encode()) + 3
    longest = 0
    for source, split, examples in ((a.dataset, "train", train), (a.eval_dataset, "test", evals)):
        for i in [i for i, ex in enumerate(examples) if every or len(ex["prompt"].encode()) + bound > room]:
            text = prompt_text(tok, examples[i], a, tools)  # one at a time (each holds the tools' schemas)
            ids = tok(text, add_special_tokens=not tok.chat_template).input_ids
            if len(ids) > room:  # refused now, not met hours in as an allocation error inside generate
                where = read_records(source, split)[i][0] if source else "the built-in task"
                fail(f"{where}: a prompt of {len(ids)} tokens, with --max-new-tokens {a.max_new_tokens}, is "
                     f"over the model's context ({room + a.max_new_tokens}): shorten it, or lower T")
            longest = max(longest, len(ids))
    return longest

def make_sampler(model, a: Args, prompt_len: int, rows: int, compiled: bool = False) -> dict | None:
    """The decode loop's shape, rows x (prompt_len + T) (a smaller call padded to it), its static KV cache for
    the run. compiled: decode_step compiled once for all positions and calls, reading the weights in place."""
    from transformers import StaticCache
    if compiled and (a.load_in_4bit or a.lora_r == 0 and use_bf16(a, model.device)):  # see "Design notes"
        print("grpo: note: QLoRA, and full fine-tuning in bf16, sample uncompiled", file=sys.stderr)
        return None
    kw = dict(mode="reduce-overhead") if model.device.type == "cuda" else dict(backend="eager")  # CUDA graphs
    step = torch.compile(decode_step, dynamic=False, **kw) if compiled else decode_step  # (CPU: traced)
    cache = StaticCache(config=model.config, max_cache_len=prompt_len + a.max_new_tokens)
    return dict(prompt_len=prompt_len, rows=rows, cache=cache, step=step)

def parse_tool_calls(text: str) -> list[dict]:
    """The calls a turn makes, in Qwen2.5's (Hermes') format: <tool_call>{"name": ..., "arguments": {...}}"""
    calls = []  # FORKER: another family's format goes here
    for part in text.split("<tool_call>")[1:]:
        body = part.partition("</tool_call>")[0]
        try:
            call = json.loads(body)
            calls.append({"name": call["name"], "arguments": call["arguments"]})
        except (ValueError, TypeError, KeyError):  # not JSON, not an object, without either: its text
            calls.append({"name": None, "arguments": body})
    return calls

def tool_turn(tok, eos: list[int], calls: list[dict], room: int) -> list[int]:
    """The tokens from a turn that made calls to the next: each result as a tool message, then the generation
    prompt, as the chat template renders them (as TRL's), within room: a result is cut at 8 chars a token."""
    chat = [{"role": "user", "content": ""}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": c["name"], "arguments": {}}} for c in calls]}]
    results = [{"role": "tool", "name": c["name"], "content": c["result"][:8 * room]} for c in calls]
    head = tok.apply_chat_template(chat, return_dict=False)
    full = tok.apply_chat_template(chat + results, return_dict=False, add_generation_prompt=True)
    end = max(i for i, t in enumerate(head) if t in eos) + 1  # after the turn's EOS, the model's own
    if full[:end] != head[:end]:
        fail("--tools: the chat template renders a turn that made calls otherwise once results follow it")
    return full[end:end + room]

def load_tools(a: Args, tok, records=()) -> dict:
    """--env: a class, an instance a completion (TRL's environment_factory); --tools: one without state."""
    from transformers.utils import get_json_schema  # from type hints and docstrings, as TRL's
    path, names = split_path(a.env or a.tools)
    what = f"--env {a.env!r}" if a.env else f"--tools {a.tools!r}"
    if a.tools == "calculator":  # the built-in, rewards.py's
        path, names = inspect.getfile(calculator), ":calculator"
    try:
        sys.path.insert(0, os.path.dirname(path))  # its folder's modules importable, as when it is run
        found = runpy.run_path(path)  # as --reward-fn's file; the calls run in a process of their own
        env = found.get(names[1:]) if a.env else None  # --env: the class, its methods offered bound (no self)
        if a.env and not (isinstance(env, type) and callable(getattr(env, "reset", None))):
            raise TypeError(f"no class {names[1:]!r} with a reset(self, **record): --env PATH.py:Class")
        fns = {k: v.__get__(env) if a.env else v  # (an --env's inherited methods too)
               for k, v in (dict(inspect.getmembers(env)) if a.env else found).items()
               if inspect.isfunction(v) and v.__module__ == "<run_path>" and k[0] != "_" and k != "reset"}
        chosen = names[1:].split(",") if names and not a.env else list(fns)
        schemas = [get_json_schema(fns[k]) for k in chosen if k in fns]
        json.dumps(records)  # (a record goes to the tools' process, as JSON)
    except (Exception, SystemExit) as e:  # a file that does not load, a record that is not JSON: one line
        fail(f"{what}: {type(e).__name__}: {e}")
    for k in chosen or [""]:  # each a public function (or method), its arguments named (no *args, **kwargs)
        if k not in fns or {p.kind for p in inspect.signature(fns[k]).parameters.values()} & {2, 4}:
            fail(f"{what}: no public function {k!r} (typed, documented, no *args or **kwargs) in {path}")
    shown = chat_prompt(tok, "", "", {"schemas": schemas})
    if not all(s["function"]["name"] in shown for s in schemas):
        fail(f"{what}: the chat template (--model's) shows no tool: {shown[:60]!r}")
    tool_turn(tok, [tok.eos_token_id], [{"name": "f", "result": ""}], 1)  # a tool message renders
    argv = [sys.executable, "-c", TOOL_WORKER, path, names[1:] if a.env else ""]
    return dict(schemas=schemas, names=chosen, argv=argv, proc=None, timeout=a.tool_timeout,
                dir=tempfile.TemporaryDirectory(prefix="grpo_tools_"))

TOOL_WORKER = r"""if True:  # `python -c`: a fresh interpreter (without torch) in a directory of its own
    import asyncio, inspect, json, os, runpy, sys, types
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8", errors="replace")  # (a lone surrogate sent as '?')
    calls = os.fdopen(os.dup(0), encoding="utf-8")
    for fd in (0, 1, 2):  # what a tool reads, prints or logs: /dev/null
        os.dup2(os.open(os.devnull, os.O_RDWR), fd)
    sys.path.insert(0, os.path.dirname(sys.argv[1]))  # the tools file's directory, as when it is run
    found = runpy.run_path(sys.argv[1])  # --tools: an environment without state, its functions, no reset
    make = found.get(sys.argv[2]) or (lambda: types.SimpleNamespace(**found, reset=lambda **record: None))
    envs = {}  # a completion (its row) -> its instance, made by its reset (for a call: after a crash)
    print("{}", file=replies, flush=True)  # ready: its import counts against no call's --tool-timeout
    for row, record, name, arguments in map(json.loads, calls):
        try:
            if name == "reset" or row not in envs:  # (__init__ or reset raised: this call's error)
                envs.pop(row, None)
                out = (env := make()).reset(**record)
                envs[row] = env
            out = out if name == "reset" else getattr(envs[row], name)(**arguments)
            out = asyncio.run(out) if inspect.iscoroutine(out) else out  # async def: run to its end
            reply = {"result": "" if out is None else str(out)}
        except BaseException as e:
            reply = {"result": f"error: {type(e).__name__}: {e}", "error": True}
        state = vars(envs[row]) if row in envs and sys.argv[2] else {}  # --env: its public attributes
        reply["env"] = {k: v for k, v in state.items() if k[0] != "_"}
        reply.update({"done": True} if state.get("done") else {})  # the episode is over
        print(json.dumps(reply, ensure_ascii=False, default=repr), file=replies, flush=True)
"""

def run_tool(tools: dict, call: dict, row: int = 0, episode=None) -> dict:
    """A call of a row's (completion's) instance, in the tools' process -> it, its result (what the model
    reads), "error" if it failed, "done" if it ended the episode; episode: its record in, "env" out."""
    import atexit  # (imported here: only a run with --tools needs these)
    import select
    import subprocess
    if "arguments" in call and (call["name"] not in tools["names"] or type(call["arguments"]) is not dict):
        return {**call, "result": f"error: call one of {tools['names']} with a JSON object", "error": True}
    if tools["proc"] is None or tools["proc"].poll() is not None:  # (again after a crash or a timeout)
        end_worker(tools)  # what its tools started, too
        tools["proc"] = subprocess.Popen(tools["argv"], cwd=tools["dir"].name, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, encoding="utf-8", start_new_session=True)
        atexit.register(end_worker, tools)  # a run that stops while a tool hangs leaves no process behind
        tools["proc"].stdout.readline()  # ready: the file imported (or nothing, if it could not be)
    proc, ep = tools["proc"], episode or {"record": {}}
    try:
        message = [row, ep["record"], call["name"], call.get("arguments")]  # (a reset has no arguments)
        print(json.dumps(message), file=proc.stdin, flush=True)
        ready = select.select([proc.stdout], [], [], tools["timeout"])[0]
    except BrokenPipeError:  # it ended after its last reply: this call's error, not the run's
        ready = None
    line = proc.stdout.readline() if ready else ""
    if line.endswith("\n"):
        ep["env"] = (reply := json.loads(line)).pop("env")
        return {**call, **reply}
    late = ready == [] and proc.poll() is None  # (else it ended, though a child it forked may hold the pipe)
    end_worker(tools)
    why = f"ran past --tool-timeout {tools['timeout']:g} s" if late else f"exit code {proc.returncode}"
    return {**call, "result": f"error: its process was ended ({why})", "error": True, "timeout": late}

def end_worker(tools: dict):  # its process group: all a tool started (unless in a session of its own)
    proc, tools["proc"] = tools["proc"], None
    with suppress(ProcessLookupError, AttributeError):  # (no process left in it; None: none started)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

# ----------------------------------------------------------------------------- reward and groups
def parse_rewards(spec: str) -> list[tuple[str, str, float]]:
    """--rewards, the one parse of it: "correct:1, format : 0.2" -> (name, weight as written, its value)."""
    out = []
    for part in filter(None, spec.split(",")):
        name, _, weight = [s.strip() for s in part.partition(":")]
        try:
            out.append((name, weight, float(weight or 1)))
        except ValueError:
            out.append((name, weight, math.nan))
    return out

def build_rewards(a: Args) -> list[tuple[str, object, float]]:
    known = dict(REWARDS)
    if bool(a.reward_model) != ("model" in [name for name, _, _ in parse_rewards(a.rewards)]):
        fail("--reward-model and the reward `model` go together: --reward-model ID --rewards model:0.5")
    if a.reward_model:  # on this rank's device, in the policy's dtype (bf16 or fp32; NF4 with --load-in-4bit)
        device = setup_distributed()[2]
        try:
            known["model"] = reward_model(a.reward_model, functools.partial(prompt_text, a=a),
                                          a.micro_batch_size, device, use_bf16(a, device), a.load_in_4bit)
        except (OSError, ValueError) as e:  # not there; not a classifier of one label
            fail(f"--reward-model {a.reward_model!r}: {str(e).splitlines()[0]}")
    fns = []
    for name, written, weight in parse_rewards(a.rewards):
        if name not in known:
            fail(f"--rewards: unknown reward {name!r}; built-ins are {', '.join(REWARDS)}")
        if not finite32(weight):
            fail(f"--rewards: weight {written!r} of {name!r} is not a number finite in float32")
        fns.append((name, known[name], weight))
    if a.reward_fn:
        path, _, name = a.reward_fn.rpartition(":")
        if not path.endswith(".py") or not os.path.isfile(path):
            fail(f"--reward-fn {a.reward_fn!r}: expected an existing PATH.py:FUNCTION")
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # its folder's modules importable
        try:
            fn = runpy.run_path(path).get(name)  # the file's globals
        except SystemExit as e:  # sys.exit() as it loads: the run would end there, saying nothing
            fail(f"--reward-fn: {path} called sys.exit({e.code!r}) as it loaded")
        if not callable(fn):
            fail(f"--reward-fn: {path} has no function {name!r}")
        fns.append((name, fn, 1.0))
    if a.overlong_penalty:  # DAPO §3.4's shaping of R, L_max = T: a reward, weight 1 (reward/overlong)
        fns.append(("overlong", functools.partial(overlong_penalty, a.overlong_buffer), 1.0))
    if len({name for name, _, _ in fns} - {"mean", "std"}) < len(fns):  # each is logged as reward/<name>
        fail(f"a reward is named twice, or mean or std (metrics'): {[name for name, _, _ in fns]}: rename it")
    return fns

def score(rows: list[dict], reward_fns, a: Args):
    """The rows' (generate's) rewards (n,): each function's values (by name), weighted and summed."""
    per_fn = {}
    for name, fn, weight in reward_fns:
        try:
            if getattr(fn, "batched", False):  # rewards.reward_model: the completions in one call
                values = fn([r["text"] for r in rows], [r["record"] for r in rows])
            else:  # a completion, its answer, and as keywords its record's other fields (as TRL's)
                values = [fn(r["text"], r["record"]["answer"], **reward_keywords(a, r)) for r in rows]
        except (Exception, SystemExit) as e:  # a user's reward: say which one and why, then stop
            fail(f"reward {name!r} raised {type(e).__name__}: {e}")
        for v in itertools.filterfalse(finite32, values):  # the first value that is no reward stops the run
            fail(f"reward {name!r} returned {v!r:.60}: a reward is a number, finite in float32")
        per_fn[name] = torch.tensor([float(v) for v in values])
    return sum((weight * per_fn[name] for name, _, weight in reward_fns), torch.zeros(len(rows))), per_fn

def pass_at_k(n: int, c: int, k: int) -> float:  # of n samples, c correct: P(one of k drawn is), unbiased
    return 1 - math.comb(n - c, k) / math.comb(n, k)  # (Chen et al. 2021, 2107.03374, eq. 1)

def reward_keywords(a: Args, row: dict = dict(record={}, completion=())) -> dict:  # (none: but a record's)
    """As TRL's: the record's fields but its answer; length, in tokens (the tools' too, as T counts them);
    max_length, T (rewards.cosine's L_max); --tools, --env: tool_calls (name, arguments, result; error,
    timeout, done); --env: env, a copy of the instance's public state as the episode ended."""
    kw = {k: v for k, v in row["record"].items() if k != "answer"}
    kw |= {"length": len(row["completion"]), "max_length": a.max_new_tokens}
    kw |= {"tool_calls": list(row.get("tool_calls", []))} if a.tools or a.env else {}
    return kw | ({"env": argparse.Namespace(**row.get("env", {}))} if a.env else {})

def group_size(a: Args) -> int:  # G: the samples and the teacher's completions of a prompt
    return a.num_generations + a.teacher_per_group

def equal(rewards: torch.Tensor) -> torch.Tensor:  # (n, G) -> (n,): the groups whose rewards are all equal
    return rewards.max(-1).values == rewards.min(-1).values

def select_groups(rewards: torch.Tensor, a: Args) -> tuple[torch.Tensor, bool, str]:
    """rewards (n, G): every rank's groups so far -> the indices to train, enough, --dry-run's words."""
    if not a.max_new_tokens * rewards.double().abs().sum() ** 2 < torch.finfo(torch.float32).max:  # A's sums
        fail(f"rewards up to {rewards.abs().max():.3g} overflow float32 in the advantages' sums (T (Σ|R|)² "
             f"over 3.4e38): scale them")
    keep = torch.arange(len(rewards))
    words = "all"  # FORKER: a filter from here to `enough` is refilled by sampling again; one after it is not
    if a.dynamic_sampling:  # DAPO §3.2: the groups whose rewards differ
        keep = keep[~equal(rewards)]
        words = f"dynamic sampling (≤{a.max_gen_rounds} rounds)"
    enough = len(keep) >= a.prompts_per_step  # else rollout samples again, till B or max_gen_rounds
    keep = keep[:a.prompts_per_step]  # the first B kept, in the order one process samples them
    if a.top_k_groups:  # the hard variance filter (RAGEN, 2504.20073 §4): the k groups of largest std
        by_std = torch.argsort(rewards[keep].std(1), descending=True, stable=True)
        keep = keep[by_std[:a.top_k_groups].sort().values]
        words += f", then the top-{a.top_k_groups} by std"
    return keep, enough, words

def counted(stream, state: dict):  # from where the run left off, each prompt drawn counted in its state
    for ex in itertools.islice(stream, state["prompts_drawn"], None):
        state["prompts_drawn"] += 1
        yield ex

def draw(stream, a: Args, state: dict) -> tuple[list[dict], str]:
    """A round's B prompts (every rank's), --dry-run's words. FORKER: a curriculum skips examples here (the
    stream counts each for --resume); state["scored"]: every rank's groups scored since the last draw."""
    return [next(stream) for _ in range(a.prompts_per_step)], f"B = {a.prompts_per_step} prompts q a step"

def rollout(model, tok, stream, reward_fns, pool, a: Args, state, sampler=None, rank=0, world=1, tools=None):
    """In rounds: this rank's share of B prompts, G_s samples, G_t teacher completions each, scored; those to
    train chosen from every rank's -> this rank's rows to train (in sampling order), metrics, all sampled."""
    G_s = a.num_generations
    groups = []  # a prompt's G rows, as generate makes them, scored, its teacher's completions after them
    stats = {"time/generate": 0.0, "time/reward": 0.0}
    for rounds in range(1, a.max_gen_rounds + 1):
        drawn = draw(stream, a, state)[0][rank::world]  # whole groups per rank
        t0 = time.time()
        rows = [dict(record=ex, order=(rounds - 1) * a.prompts_per_step + rank + i * world, is_teacher=False)
                for i, ex in enumerate(drawn) for _ in range(G_s)]  # order: the group's place in the step's
        generate(model, tok, rows, a, sampler=sampler, tools=tools)
        t1 = time.time()
        rewards, per_fn = score(rows, reward_fns, a)
        for i, r in enumerate(rows):
            r.update(reward=rewards[i].item(), rewards={k: v[i].item() for k, v in per_fn.items()})
        for i, ex in enumerate(drawn):  # a teacher's row: its group's prompt, record and order; no log-probs
            group = rows[i * G_s:(i + 1) * G_s]
            picks = random.sample(pool[ex["prompt"]], a.teacher_per_group) if pool else []
            groups.append(group + [dict(
                group[0], completion=ids, text=text, reward=reward, truncated=False, is_teacher=True,
                logp=torch.full((len(ids),), math.nan), tool_mask=torch.ones(len(ids)), tool_calls=[],
                rewards=dict.fromkeys(per_fn, math.nan)) for text, ids, reward in picks])
        stats["time/generate"] += t1 - t0
        stats["time/reward"] += time.time() - t1
        sampled = [(g[0]["order"], g[0]["record"]["prompt"], [r["reward"] for r in g]) for g in groups]
        everyone = sorted(sum(all_gather(sampled), []))
        state["scored"] = [(prompt, r) for _, prompt, r in everyone[-a.prompts_per_step:]]  # this round's
        keep, enough, _ = select_groups(torch.tensor([r for _, _, r in everyone]), a)
        if enough:
            break
    chosen = {everyone[i][0] for i in keep.tolist()}
    generated = sum(groups, [])
    stats.update(peak_memory(model.device, "generate"))  # since the last step's training: sampling, rewards
    stats.update({"groups/gen_rounds": rounds, "groups/kept": len(chosen), **group_metrics(generated, a)})
    return [r for r in generated if r["order"] in chosen], stats, generated

def group_metrics(generated: list[dict], a: Args) -> dict:
    """Rewards, lengths and accuracy (by `correct`, whatever trains) of every rank's rows (whole groups)."""
    rows = sum(all_gather(sample_rows(generated, 0)), [])
    students = [r for r in rows if not r["teacher"]]
    reward = torch.tensor([r["reward"] for r in rows], dtype=torch.float64)
    length = torch.tensor([r["length"] for r in students], dtype=torch.float64)
    out = {"reward/mean": reward.mean().item(), "reward/std": reward.std().item(), "groups/equal_frac":
           statistics.mean(equal(reward.view(-1, group_size(a))).tolist()),
           "accuracy": statistics.mean(r["correct"] for r in students),
           "completion/tokens": length.sum().item(), "completion/mean_length": length.mean().item(),
           "completion/max_length": length.max().item(),
           "completion/truncated_frac": statistics.mean(r["truncated"] for r in students)}
    for name in students[0]["rewards"]:
        out[f"reward/{name}"] = statistics.mean(r["rewards"][name] for r in students)
    for source in ("student", "teacher") if len(students) < len(rows) else ():  # the mixed pool: per source
        part = [r for r in rows if r["teacher"] == (source == "teacher")]
        out[f"reward/mean_{source}"] = statistics.mean(r["reward"] for r in part)
        out[f"completion/mean_length_{source}"] = statistics.mean(r["length"] for r in part)
    if a.tools or a.env:  # calls a completion; the share of completions that call, of calls that fail, time
        per = [len(r["tool_calls"]) for r in students]  # out; the model's turns an episode, the share done
        calls = [c for r in students for c in r["tool_calls"]] or [{}]  # ({}: no call, no error)
        turns = [int((r["tool_mask"].diff() > 0).sum()) + 1 for r in generated if not r["is_teacher"]]
        out.update({"tools/calls": statistics.mean(per), "tools/call_frac": statistics.mean(map(bool, per))})
        out.update({f"tools/{k}s": statistics.mean(c.get(k, 0) for c in calls) for k in ("error", "timeout")})
        out["env/turns"] = statistics.mean(sum(all_gather(turns), []))
        out["env/done_frac"] = statistics.mean(any(c.get("done") for c in r["tool_calls"]) for r in students)
    return out

def collate(rows: list[dict], pad_id: int, device) -> dict:
    """Rows (generate's, scored) -> padded tensors, a row a completion (N = 0 on a rank that kept none)."""
    def pad(x: list, value=0, side="right"):  # (N, the longest): the rows' tensors x, padded on one side
        return torch.nn.utils.rnn.pad_sequence(x or [torch.zeros(0)], True, value, side)[:len(rows)]
    prompts = [r["prompt_ids"] for r in rows]
    completions = pad([r["completion"] for r in rows], pad_id)  # (N, C)
    ids = torch.cat([pad(prompts, pad_id, "left"), completions], 1).long()  # (N, P+C), prompts left-padded
    attn = torch.cat([pad([torch.ones_like(p) for p in prompts], 0, "left"), torch.ones_like(completions)], 1)
    batch = dict(input_ids=ids, attention_mask=attn.long(),  # after-EOS padding attended: causal, masked out
                 mask=pad([r["tool_mask"] for r in rows]),  # (N, C); --tools: 0 on a tool's tokens
                 sampler_logp=pad([r["logp"] for r in rows], math.nan),  # (N, C); NaN: unknown (teacher rows)
                 reward=torch.tensor([r["reward"] for r in rows]),  # (N,)
                 per_fn=torch.tensor([[*r["rewards"].values()] for r in rows] or [[]])[:len(rows)],  # (N, K)
                 order=torch.tensor([r["order"] for r in rows], dtype=torch.long),  # the group's place
                 truncated=torch.tensor([r["truncated"] for r in rows], dtype=torch.bool),
                 temperature=torch.tensor([[r["record"].get("temperature", math.nan)] for r in rows]),  # N, 1
                 is_teacher=torch.tensor([r["is_teacher"] for r in rows], dtype=torch.bool))
    return {k: v.to(device) for k, v in batch.items()}

# ----------------------------------------------------------------------------- log-probs: the step's inputs
def token_logps(model, input_ids, attention_mask, n_completion: int, temperature=1.0):
    """Log-probs, entropy (N, C) of the last C tokens, with gradient, at a temperature or a row's (N, 1)."""
    pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos,
                                 use_cache=False).last_hidden_state[:, -n_completion - 1:-1]  # (N, C, H)
    head = model.get_output_embeddings()
    hidden = hidden.reshape(-1, hidden.shape[-1])  # (N*C, H)
    targets = input_ids[:, -n_completion:].reshape(-1)  # (N*C,)
    temps = torch.as_tensor(temperature, device=hidden.device).expand(len(input_ids), n_completion)  # (N, C)
    def chunk(h, tgt, temp):  # (n, H), (n,), (n,) -> (2, n): logp, entropy; hidden state t predicts token t+1
        logits = head(h).float() / temp[:, None]  # (n, V)
        lse = logits.logsumexp(-1)
        entropy = lse - (logits.softmax(-1) * logits).sum(-1)  # from the same logits: no extra pass
        return torch.stack([logits.gather(-1, tgt[:, None])[:, 0] - lse, entropy])
    n = max(1, 2 ** 24 // head.weight.shape[0])  # tokens a chunk, recomputed in backward: no (N, C, V) logits
    pieces = [checkpoint(chunk, *x, use_reentrant=False)
              for x in zip(hidden.split(n), targets.split(n), temps.reshape(-1).split(n))]
    return torch.cat(pieces, 1).view(2, len(input_ids), -1).unbind()  # logp, entropy (N, C)

def policy_logps(model, batch: dict, idx: list[int], a: Args):  # -> logp, entropy (n, C) of the rows idx
    with autocast(a, batch["mask"].device):
        C = batch["mask"].shape[1]
        temp = batch["temperature"][idx].nan_to_num(a.temperature)  # the row's (its record's), else a's
        return token_logps(model, batch["input_ids"][idx], batch["attention_mask"][idx], C, temp)

def step_inputs(model, ref_model, batch: dict, names: set, a: Args):
    """batch[name] (N, C) for each step input a term reads (probe), in micro-batches: old_logp, old_entropy
    (the policy before the step's first update), ref_logp, ref_entropy (the reference: the policy with LoRA
    off, or full fine-tuning's frozen copy). FORKER: another input (a value head's output) is a line here."""
    chunks = [c.tolist() for c in torch.arange(len(batch["mask"])).split(a.micro_batch_size) if len(c)]
    for who, policy, lora_off in (("old", model, False), ("ref", ref_model or model, ref_model is None)):
        if names & {f"{who}_logp", f"{who}_entropy"}:
            with torch.no_grad(), model.disable_adapter() if lora_off else nullcontext():
                parts = [policy_logps(policy, batch, idx, a) for idx in chunks] or [[batch["mask"]] * 2]
            batch[f"{who}_logp"], batch[f"{who}_entropy"] = (torch.cat(x) for x in zip(*parts))

def gather_step(batch: dict, pad: float = 0.0) -> tuple[dict, torch.Tensor]:
    """Every rank's rows in sampling order, as one process has them; where this rank's are among them."""
    mine = {k: v.cpu() for k, v in batch.items() if k not in ("input_ids", "attention_mask")}
    every = all_gather(mine)
    def widen(k, x):  # (n, C_rank) -> (n, C), C the longest
        width = max(part[k].shape[-1] for part in every)
        return torch.nn.functional.pad(x, (0, width - x.shape[-1]), value=pad) if x.dim() == 2 else x
    step = {k: torch.cat([widen(k, part[k]) for part in every]) for k in mine}
    order = torch.argsort(step["order"], stable=True)  # a group's rows stay together, in their order
    start = sum(len(part["order"]) for part in every[:dist.get_rank() if dist.is_initialized() else 0])
    return {k: v[order] for k, v in step.items()}, order.argsort()[start:start + len(mine["order"])]

# ----------------------------------------------------------------------------- advantage and loss mask
def group_advantages(rewards: torch.Tensor, scale: str = "std", eps: float = 1e-6):
    """rewards (B, G) -> adv (B, G), 0 in an equal-reward group (not R - mean's rounding); --dry-run's."""
    adv = torch.where(equal(rewards)[:, None], 0.0, rewards - rewards.mean(1, keepdim=True))
    if scale == "std":  # GRPO (2402.03300) §4.1.2; std unbiased (torch's default, as TRL and verl)
        return adv / (rewards.std(1, keepdim=True) + eps), f"(R_i - mean_g(R)) / (std_g(R) + {eps:g})"
    if scale == "batch":  # Lite PPO (2508.08221): the group's mean, the step's std (TRL's "batch")
        return adv / (rewards.std() + eps), f"(R_i - mean_g(R)) / (std(R) + {eps:g})"
    return adv, "R_i - mean_g(R)"  # scale='none', Dr. GRPO (2503.20783) §3.1

def soft_weights(stds: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Dr. GRPO+ soft reweighting, no paper: RAGEN's top-k variance filter (2504.20073 §4), made soft."""
    return stds / (stds.max() + eps)  # w_g = std_g / (max_g' std_g' + eps), the max over the step's groups

def step_terms(s: dict, a: Args, state: dict):
    """The reward-, advantage- and mask-level terms on every rank's rows as one process has them (a quantile
    sees them all). s: collate's tensors (reward (M,), mask (M, C), ...), the step inputs a term reads, record
    (a row's: memory per prompt keys by it); state: the run's, a term's memory. -> token_objective's tensors
    by name, metrics, --dry-run's words.
    FORKER: a term, a token set or weight (a name returned), a metric of rows (in stats): a line here."""
    R, mask, stats, G = s["reward"], s["mask"], {}, group_size(a)
    words = {"R": "", "m": "1 up to and including the first EOS"}
    if a.tools or a.env:  # collate's mask: 0 on a tool's tokens, so no term, normaliser or |o_i| counts them
        words["m"] = (f"1 on the model's tokens to its last EOS, 0 on the results of ≤{a.max_tool_calls} "
                      f"calls (≤{a.tool_timeout:g} s each) and the template's tokens around them")
    if a.kl_in_reward:  # as verl's use_kl_in_reward: k1 = log π_old - log π_ref summed over o_i
        kl = torch.where(mask > 0, s["old_logp"] - s["ref_logp"], 0).sum(-1)  # (M,)
        R = R - state.setdefault("kl_in_reward", a.kl_in_reward) * kl  # this step's β (see --kl-target)
        stats.update({"kl/in_reward": kl.mean().item(), "kl/in_reward_coef": state["kl_in_reward"]})
        words["R"] += f" - {a.kl_in_reward:g}·Σ_t log π_old/π_ref"
        if a.kl_target:  # Ziegler et al. (1909.08593) §2.2, as verl's AdaptiveKLController (horizon 1e4)
            kl_t = stats["kl/in_reward_token"] = (kl / (mask.sum(-1) + 1e-8)).mean().item()  # rows' means
            state["kl_in_reward"] *= 1 + min(max(kl_t / a.kl_target - 1, -0.2), 0.2) * len(R) / 1e4  # next β
            words["R"] += f" (β = {a.kl_in_reward:g}, ×= 1 + clip(KL_t/{a.kl_target:g} - 1, ±.2)·BG/1e4)"
    rewards = R.view(-1, G)  # (groups, G)
    adv, words["A"] = group_advantages(rewards, a.scale, a.std_eps)
    if a.adv_estimator == "rloo":  # RLOO (2402.14740): R_i minus the mean of the group's other G - 1
        adv = group_advantages(rewards, "none")[0] * G / (G - 1)
        words["A"] = "R_i - mean_{j≠i}(R_j) = G/(G-1)·(R_i - mean_g(R))"
    if a.adv_estimator == "reinforce_plus_plus_baseline":  # REINFORCE++ (2501.03262), as verl's: the group
        adv = group_advantages(rewards, "none")[0]  # mean out, then whitened over the step's tokens
        L = s["mask"].sum(-1).view_as(adv)  # (a completion weighs by its length)
        mean = (L * adv).sum() / L.sum()
        adv = (adv - mean) * torch.rsqrt((L * (adv - mean) ** 2).sum() / (L.sum() - 1) + 1e-8)
        words["A"] = "(a_i - mean_t(a)) / std_t(a) over the step's tokens, a_i = R_i - mean_g(R) (no A is 0)"
    if a.adv_estimator == "gdpo":  # GDPO (2601.05242), as TRL's normalize_then_sum: each reward normalised in
        parts = s["per_fn"].T.reshape(-1, *rewards.shape)  # its group, weighted, summed, then whitened over
        weights = [w for _, _, w in parse_rewards(a.rewards)] + [1.0] * len(parts)  # build_rewards' (rest: 1)
        S = sum(w * group_advantages(r, "std", a.std_eps)[0] for w, r in zip(weights, parts))
        adv = (S - S.mean()) / (S.std() + a.std_eps)  # the step's completions
        words["A"] = "(S_i - mean(S)) / std(S), S_i = Σ_k w_k (R_k,i - mean_g(R_k)) / std_g(R_k) (no A is 0)"
    flat = (adv == 0).all(1).repeat_interleave(G)[:, None]  # (M, 1): A = 0 in the whole group (probe: skip?)
    if a.soft_reweight:  # Dr. GRPO+ soft reweighting
        w = soft_weights(rewards.std(1), a.std_eps)  # (groups,)
        adv = adv * w[:, None]
        stats.update({f"adv/soft_weight_{k}": getattr(w, k)().item() for k in ("min", "mean", "max")})
        words["A"] += f"  ·  std_g / (max_g' std_g' + {a.std_eps:g})"
    if a.mask_truncated:  # DAPO §3.4 overlong filtering: no loss, and no count in either normaliser
        mask = mask * ~s["truncated"][:, None]
        words["m"] += ", 0 on a truncated completion"
    adv = row_adv = adv.reshape(-1, 1)  # (M, 1): A_i; then token-level terms
    keep = mask > 0  # the tokens the policy loss and the entropy bonus act on
    if a.top_entropy_quantile < 1 and mask.any():  # 80/20 (2506.01939): the policy loss (and the entropy
        H = s["old_entropy"]  # bonus, as TRL's) on the top-ρ of the step's trained tokens by π_old's H
        ranked = H[keep].sort().values  # torch.quantile's linear rule; it refuses over 2^24 tokens
        at = torch.tensor(1 - a.top_entropy_quantile, dtype=H.dtype) * (len(ranked) - 1)
        keep = keep & (H >= torch.lerp(ranked[at.long()], ranked[at.ceil().long()], at - at.long()))
        adv = adv * keep  # (KL, normalisers as they were)
        stats["loss/low_entropy_frac"] = 1 - keep.sum().item() / len(ranked)  # the share of tokens dropped
        words["A"] += f"  ·  1[H_i,t ≥ its {1 - a.top_entropy_quantile:g} quantile in the step]"
    return dict(adv=adv, row_adv=row_adv, loss_mask=mask, keep=keep, flat=flat), stats, words

# ----------------------------------------------------------------------------- the token loss
def policy_loss(logp, old_logp, adv, mask, a: Args):
    """Per-token policy loss (N, C), or gmpo's (N, 1), a paper beside each choice; adv (N, 1), or (N, C).
    Diagnostics (N, C) by name (the ratio, where clipped on A's side, ...), --dry-run's words. With old_logp =
    logp.detach() (r = 1) each choice's gradient is -A grad log pi (clip_cov's: 0 at tokens it drew)."""
    log_ratio = torch.where(mask != 0, logp - old_logp, 0)  # (N, C)
    log_r = log_ratio
    words = {"r": "π_θ/π_old per token"}
    if a.ratio == "sequence":  # GSPO (2507.18071) eq. 7 (seq-mean-token-mean); LUSPO (2602.05261)
        log_r = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # (N, 1)
        words["r"] = "s_i = exp(mean_t log π_θ/π_old)"
    ratio = torch.exp(log_r).expand_as(logp)
    clipped = torch.clamp(ratio, 1 - a.eps_low, 1 + a.eps_high)
    clip = f"clip(r, 1-{a.eps_low:g}, 1+{a.eps_high:g})"
    diag = {"loss/ratio": ratio.detach(), "loss/clipfrac_low": (ratio < 1 - a.eps_low) & (adv < 0),
            "loss/clipfrac_high": (ratio > 1 + a.eps_high) & (adv > 0)}
    loss = -torch.min(ratio * adv, clipped * adv)  # PPO's clip; DAPO §3.1 clip-higher: eps_high > eps_low
    words["ℓ"] = f"-min(r·A_i, {clip}·A_i)"
    if a.surrogate == "cispo":  # MiniMax-M1 (2506.13585) eq. 4
        loss = -clipped.detach() * adv * logp
        words["ℓ"] = f"-sg({clip})·A_i·log π_θ"
    elif a.surrogate == "gmpo":  # GMPO (2507.20673), verl's geo_mean; its mean skips tokens whose A is 0
        kept = (mask != 0) & (adv != 0)  # (those the entropy quantile drops too, as TRL's GMPO)
        log_r = torch.where(adv > 0, log_ratio.clamp(max=a.eps_high), log_ratio.clamp(min=-a.eps_low)) * kept
        A = adv.expand_as(logp).gather(-1, kept.int().argmax(-1, keepdim=True))  # A_i, not x a share kept
        loss = -A * torch.exp(log_r.sum(-1, keepdim=True) / kept.sum(-1, keepdim=True).clamp(min=1))  # (N, 1)
        words["ℓ"] = f"-A_i·exp(mean_t clip(log r_t, -{a.eps_low:g}, {a.eps_high:g}) on A_i's side)"
    elif a.surrogate == "vespo":  # VESPO (2602.10693), TRL's k and λ
        log_w = log_ratio.detach().clamp(-20, 20).sum(-1, keepdim=True).clamp(math.log(1e-8), 20)  # (N, 1)
        k, lam = torch.where(adv >= 0, 2.0, 3.0), torch.where(adv >= 0, 3.0, 2.0)
        loss = -torch.exp(lam + k * log_w - lam * log_w.exp()) * adv * logp  # w = e^log_w, at most e^20
        words["ℓ"] = "-sg(w^k e^(λ(1-w)))·A_i·log π_θ (w = Π_t r_t; k, λ = 2, 3, or 3, 2 if A_i < 0)"
    elif a.surrogate in ("clip_cov", "kl_cov"):  # loss/cov_frac: the share of tokens they hold back
        loss, diag["loss/cov_frac"] = cov_loss(loss, ratio, log_ratio, logp, adv, mask, a, words)
    elif a.surrogate == "sapo":  # SAPO (2511.20347)
        tau = torch.where(adv > 0, a.sapo_tau_pos, a.sapo_tau_neg)
        loss = -(4 / tau) * torch.sigmoid(tau * (ratio - 1)) * adv
        words["ℓ"] = f"-4/τ·σ(τ(r-1))·A_i (τ = {a.sapo_tau_pos:g} if A_i > 0 else {a.sapo_tau_neg:g})"
    if a.dual_clip:  # Dual-clip PPO (1912.09729), verl's clip_ratio_c: for c ≥ 1 + eps_high, r clamped at c
        diag["loss/dual_clipfrac"] = (adv < 0) & (loss > -a.dual_clip * adv)
        loss = torch.where(adv < 0, torch.minimum(loss, -a.dual_clip * adv), loss)
        words["ℓ"] = f"min({words['ℓ']}, {a.dual_clip:g}·|A_i| if A_i < 0)"
    return loss, diag, words

def cov_loss(loss, ratio, log_ratio, logp, adv, mask, a: Args, words: dict):
    """Clip-Cov, KL-Cov (2505.22617 §4.3), verl's, on a micro-batch: PPO's loss -> theirs, tokens chosen."""
    m = mask != 0
    cov = (adv - adv.expand_as(logp)[m].mean()) * (logp - logp[m].mean()).detach()  # (N, C)
    n = max(1, int(a.cov_ratio * m.sum()))
    if a.surrogate == "clip_cov":
        free = (m & (loss == -ratio * adv) & (cov > a.cov_low) & (cov < a.cov_high)).flatten().nonzero()[:, 0]
        drawn = torch.zeros_like(m).flatten().index_fill(0, free[torch.randperm(len(free))[:n]], 1).view_as(m)
        words["ℓ"] += (f" (0 at {a.cov_ratio:g} of the tokens, drawn where {a.cov_low:g} < "
                       f"cov(A, log π) < {a.cov_high:g})")
        return loss.where(~drawn, 0), drawn
    top = cov.where(m, -math.inf).flatten().topk(n).indices  # kl_cov
    picked = torch.zeros_like(logp).flatten().index_fill(0, top, 1).view_as(logp)
    words["ℓ"] = f"-r·A_i + {a.cov_kl_coef:g}·|log r| on the top {a.cov_ratio:g} tokens by cov(A, log π)"
    return -ratio * adv + a.cov_kl_coef * picked * log_ratio.abs(), picked > 0

def kl_penalty(logp, ref_logp, kind: str = "k3", old_logp=None):
    """Per-token KL (Schulman, "Approximating KL divergence", 2020), d = log ref - log pi; gradients under pi:
      k3        e^d - d - 1: an unbiased VALUE of KL(pi || ref), GRPO (2402.03300) eq. 4; but its gradient
                (1 - ref/pi) grad log pi has the mean grad KL(ref || pi), the reverse direction
      k3_ratio  k3 · pi / pi_old, the policy loss's ratio (DeepSeek-V3.2, 2512.02556; TRL's
                use_bias_correction_kl): its gradient -(pi / pi_old) d grad log pi has the mean
                grad KL(pi || ref) under pi_old's samples. Written so (k3's value, -d's gradient): as is,
                its gradient's (1 - e^d) + (e^d - d - 1) cancels in fp32, losing all of -d past |d| ~ 20
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
    """Token losses (N, C) -> scalar (verl's names), --dry-run's words. n_seqs, n_tokens: the WHOLE step's
    normalisers (over micro-batches, ranks; None: this batch's); a row with no loss token is in neither."""
    n_seqs = (mask.sum(-1) > 0).sum() if n_seqs is None else n_seqs
    n_tokens = mask.sum() if n_tokens is None else n_tokens
    per_seq = torch.where(mask != 0, loss * mask, 0).sum(-1)  # (N,); a NaN or inf past EOS must not leak in
    if mode == "token-mean":  # DAPO §3.3
        return per_seq.sum() / max(n_tokens, 1), "Σ_i Σ_t ℓ_i,t / Σ_i |o_i|"
    if mode == "seq-mean-token-mean":  # GRPO (2402.03300) eq. 3
        per_seq = per_seq / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / max(n_seqs, 1), "Σ_i (Σ_t ℓ_i,t / |o_i|) / n_seq"
    if mode == "seq-mean-token-sum":  # Dr. GRPO+ soft (no paper)
        return per_seq.sum() / max(n_seqs, 1), "Σ_i Σ_t ℓ_i,t / n_seq"
    return per_seq.sum() / (max(n_seqs, 1) * max_len), f"Σ_i Σ_t ℓ_i,t / (n_seq·{max_len})"  # Dr. GRPO

def token_objective(logp, entropy, b: dict, a: Args):
    """A micro-batch's per-token loss ℓ (N, C), its terms in --dry-run's order, each beside its words, and
    diagnostics (N, C) by name; logp, entropy: the policy's, with gradient; b: its rows' tensors by name.
    FORKER: a new term or token weight is a line here, its words the next; a token mean, a line in diag."""
    mask = b["loss_mask"]
    old_logp = logp.detach()  # one update a step: ratio 1, no extra forward
    words = {"π_old": "sg(π_θ): one update a step, so r = 1"}
    if a.num_iterations > 1:  # teacher rows too: π_old is the policy's (advantage-weighted imitation)
        old_logp = b["old_logp"]
        words["π_old"] = f"π_θ before the first of {a.num_iterations} updates on the step's rows"
    loss, diag, more = policy_loss(logp, old_logp, b["adv"], mask, a)  # the surrogate
    words.update(more)
    known = (mask > 0) & b["sampler_logp"].isfinite()  # the sampler's own log-probs: NaN on teacher rows
    diag["sampler/logp_gap"] = (old_logp - b["sampler_logp"]).abs().where(known, math.nan)  # health check
    if a.opsm_delta < math.inf:  # off-policy sequence masking: DeepSeek-V3.2 (2512.02556) eq. 9, as TRL's
        drift = torch.where(known, b["sampler_logp"], old_logp) - logp.detach()  # teacher rows: π_old
        drift = torch.where(mask > 0, drift, 0).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)
        diag["loss/opsm_frac"] = (b["adv"] < 0) & (drift > a.opsm_delta)  # (N, 1): the rows dropped
        loss = loss * ~diag["loss/opsm_frac"]
        words["ℓ"] = f"({words['ℓ']})·1[A_i ≥ 0 or mean_t log π_sampler/π_θ ≤ {a.opsm_delta:g}]"
    # IS against the sampler: truncated (Yao et al. 2025, "Your efficient RL framework secretly brings you
    # off-policy RL training"), or masked outside [tis_min, tis] (IcePop); per token, or o_i's product
    if a.tis:
        log_w = torch.where(known, old_logp - b["sampler_logp"], 0)
        w = torch.exp(log_w if a.tis_mode.startswith("token") else log_w.sum(-1, keepdim=True))
        inside = (w >= a.tis_min) & (w <= a.tis)
        diag["loss/tis_frac"] = known & ~inside  # the tokens whose w is masked (0) or clamped
        w = torch.where(inside, w, 0) if a.tis_mode.endswith("mask") else w.clamp(a.tis_min, a.tis)
        loss = loss * torch.where(known, w, 1)  # teacher rows (no sampler): 1
        words["ℓ"] = f"({words['ℓ']})·{a.tis_mode}(π_old/π_sampler, [{a.tis_min:g}, {a.tis:g}])"
    diag["kl"] = torch.zeros_like(logp)  # k3's value, KL(pi || ref), whatever --kl trains; 0 without --beta
    if a.beta:  # KL only where the mask is on: past EOS, exp(ref - logp) can overflow, its gradient be NaN
        ref = torch.where(mask > 0, b["ref_logp"], logp.detach())
        loss = loss + a.beta * kl_penalty(logp, ref, a.kl, old_logp)
        diag["kl"] = kl_penalty(logp.detach(), ref)
        words["ℓ"] += f" + {a.beta:g}·KL_{a.kl}(π_θ, π_ref)"
    if a.entropy_coef:  # the entropy bonus (TRL's entropy_coef, verl's entropy_coeff)
        loss = loss - a.entropy_coef * entropy * b["keep"]  # (the tokens the policy loss acts on)
        words["ℓ"] += f" - {a.entropy_coef:g}·H(π_θ)"
    diag.update({"loss/token_mean": loss.detach(), "policy/entropy": entropy.detach()})
    return loss, diag, words

# ----------------------------------------------------------------------------- the step
def probe(a: Args):
    """The step's terms on made-up numbers, no model -> the inputs they read, not step_terms' outputs (a step
    computes these, only these); whether an equal-reward group may be skipped; each term's --dry-run words."""
    G, M = group_size(a), 2 * group_size(a)  # two groups: the first's rewards equal; lengths 1 to 3
    gen = torch.Generator().manual_seed(0)
    def made_up():  # (M, 3) log-probs: any step input a term reads
        return torch.rand(M, 3, generator=gen).log()
    rows = dict(reward=torch.cat([torch.zeros(G), torch.arange(G) % 2.0]), order=torch.arange(M) // G,
                mask=(torch.arange(3) <= torch.arange(M)[:, None] % 3).float(), truncated=torch.zeros(M) > 0,
                is_teacher=torch.zeros(M, dtype=torch.bool), sampler_logp=made_up(), per_fn=made_up(),
                record=[{"prompt": "", "answer": ""}] * M)
    step = collections.defaultdict(made_up, rows)
    state = {}  # (a state of its own)
    made, _, words = step_terms(step, a, state)
    later = step_terms(step, a, state)[0]["flat"]  # the same rows a step later: a term that remembers
    step.update(made, adv=torch.zeros(M, 1))  # A = 0
    logp = made_up().requires_grad_()
    entropy = torch.rand(M, 3, generator=gen).requires_grad_()
    loss, _, more = token_objective(logp, entropy, step, a)
    loss.sum().backward()
    skip = a.skip_zero_variance and not logp.grad.any() and (entropy.grad is None or not entropy.grad.any())
    words["equal"] = "(A = 0) skipped: ∇ℓ = 0 there" if skip else "(A = 0) trained"
    if not made["flat"][:G].all():  # the equal group's A is not 0 (whitened, or the KL in R): not flagged
        words["equal"] = "trained: their A is not 0"
    if not later.equal(made["flat"]):  # (a running baseline: A = 0 only for a prompt with no history)
        words["equal"] = f"as the run's state ({', '.join(state)}) has it; at the first step {words['equal']}"
    return set(step) - set(rows) - set(made), skip, {**words, **more}

def prepare(model, ref_model, rows: list[dict], a: Args, state: dict | None):
    """Before the step's first update: this rank's rows with their step inputs and share of step_terms'
    tensors (A_i in each row too, for samples.jsonl); the rows to train (see probe); the normalisers."""
    device = next(model.parameters()).device
    batch = collate(rows, model.generation_config.pad_token_id, device)
    reads, skip_flat, _ = probe(a)
    step_inputs(model, ref_model, batch, reads, a)
    s, mine = gather_step(batch)
    records = sum(all_gather([(r["order"], r["record"]) for r in rows]), [])  # every rank's, in s's order
    s["record"] = [record for _, record in sorted(records, key=lambda x: x[0])]  # (stable: a group's rows)
    made, stats, _ = step_terms(s, a, {} if state is None else state)  # None: a step on its own
    mask = made["loss_mask"]  # every rank's
    n_seqs, n_tokens = torch.stack([(mask.sum(-1) > 0).sum().float(), mask.sum()]).tolist()
    batch.update({k: v[mine, :batch["mask"].shape[1]].to(device) for k, v in made.items()})
    for r, adv in zip(rows, made["row_adv"][mine, 0].tolist()):
        r["adv"] = adv
    trained = (batch["loss_mask"].sum(-1) > 0) & ~(made["flat"][mine, 0].to(device) & skip_flat)
    return batch, trained.nonzero()[:, 0].tolist(), n_seqs, n_tokens, stats

def train_step(model, ref_model, opt, rows: list[dict], a: Args, state: dict | None = None) -> dict:
    """num_iterations updates on a step's rows, by micro-batch -> the last update's metrics, all ranks'."""
    params = [p for p in model.parameters() if p.requires_grad]
    batch, trained, n_seqs, n_tokens, stats = prepare(model, ref_model, rows, a, state)
    chunks = [trained[i:i + a.micro_batch_size] for i in range(0, len(trained), a.micro_batch_size)]
    mask, teacher = batch["loss_mask"], batch["is_teacher"][:, None].float()  # the pool's halves, one norm.
    parts = {"student": mask * (1 - teacher), "teacher": mask * teacher} if a.split_grads else {"all": mask}
    wanted = collections.defaultdict(lambda: torch.ones(1, 1))
    step_stats(wanted)  # the diagnostics it reads (as probe finds a term's inputs): only they are gathered
    for update in range(a.num_iterations):
        for p in params:
            p.grad = torch.zeros_like(p)
        grads = {name: [torch.zeros_like(p) for p in params] for name in parts if a.split_grads}
        sums = {"loss": 0.0, "train/rows": len(trained)}
        tokens = {k: torch.full_like(mask, math.nan) for k in wanted}  # (N, C) each, NaN where not defined
        for idx in chunks:
            logp, entropy = policy_logps(model, batch, idx, a)
            b = {k: v[idx] for k, v in batch.items() if k not in ("input_ids", "attention_mask")}
            loss, diag, _ = token_objective(logp, entropy, b, a)
            for name, part in parts.items():
                agg, _ = aggregate_loss(loss, part[idx], a.loss_agg, a.max_new_tokens, n_seqs, n_tokens)
                agg.backward(retain_graph=name == "student")
                sums["loss"] += agg.detach()
                for p, g in zip(params, grads.get(name, [])):  # harvested and reset between the passes,
                    g += p.grad  # else the second would hold g_s + g_t
                    p.grad.zero_()
            for key, x in diag.items():  # each over the tokens where it is defined
                valid = (mask[idx] > 0) & x.isfinite()
                sums[key] = sums.get(key, 0) + torch.where(valid, x, 0).sum()
                sums["n:" + key] = sums.get("n:" + key, 0) + valid.sum()
                tokens.get(key, torch.empty_like(mask))[idx] = torch.where(valid, x, math.nan)  # (or dropped)
        for g in sum(grads.values(), []) or [p.grad for p in params]:
            all_sum(g)  # the step's gradient: the ranks' SUM (each loss carries the global normaliser)
        out, _ = edit_source_grads(grads, params, a)
        every = all_gather({k: float(v) for k, v in sums.items()})
        total = {k: sum(d.get(k, 0.0) for d in every) for k in set().union(*every)}
        norm = torch.nn.utils.clip_grad_norm_(params, a.max_grad_norm or math.inf).item()
        if not math.isfinite(norm + total["loss"]):  # not applied (the step's earlier updates were)
            rows_trained = total["train/rows"]  # every rank's
            return {**stats, "train/not_finite": 1.0, "train/updates": update, "train/rows": rows_trained}
        out["grad/norm"] = norm
        opt.step()
        opt.zero_grad(set_to_none=True)
    out.update({k: total[k] / total["n:" + k] for k in total if total.get("n:" + k)})
    out.update(step_stats(gather_step({**tokens, "order": batch["order"]}, math.nan)[0]))
    out.update(peak_memory(model.device, "train"))
    return {**stats, **out, "loss": total["loss"], "train/rows": total["train/rows"]}

def peak_memory(device, phase: str) -> dict:  # CUDA: memory/PHASE_gib, torch's peak since the last call
    if device.type != "cuda":
        return {}
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30
    torch.cuda.reset_peak_memory_stats(device)  # the next phase's starts
    return {f"memory/{phase}_gib": peak}

def step_stats(d: dict) -> dict:
    """Statistics but the means (train_step's): d[name] (M, C), a diagnostic of every rank's tokens."""
    out = {}  # FORKER: another statistic of one (a quantile, a max; a step may have no token) is a line here
    gap = d["sampler/logp_gap"]
    if gap.isfinite().any():  # the sampler's health check at its worst token
        out["sampler/logp_gap_max"] = gap[gap.isfinite()].max().item()
    return out

def edit_source_grads(grads: dict, params: list, a: Args) -> tuple[dict, str]:
    """--split-grads: g_s, g_t, the step's student and teacher gradients, unclipped -> .grad = g_s + g_t."""
    words = "; ∇ = g_s + g_t, the student's and the teacher's rows backpropagated apart"
    if not grads:  # none without --split-grads; --dry-run's call
        return {}, words if a.split_grads else ""
    g_s, g_t = grads["student"], grads["teacher"]  # FORKER: project or drop either here
    norm_s, norm_t = (torch.sqrt(sum((g * g).sum() for g in part)) for part in (g_s, g_t))
    cos = sum((s * t).sum() for s, t in zip(g_s, g_t)) / (norm_s * norm_t).clamp(min=1e-30)
    for p, s, t in zip(params, g_s, g_t):
        p.grad = s + t
    return {"grad/norm_student": norm_s.item(), "grad/norm_teacher": norm_t.item(),
            "grad/cos_student_teacher": cos.item()}, words

# ============================================================================= run-keeping
# Nothing below changes the algorithm: evaluation, processes, checkpoints, logs, signals, --dry-run, main().

@torch.no_grad()
def evaluate(model, tok, examples: list[dict], a: Args, rank=0, world=1, sampler=None, tools=None) -> dict:
    """Greedy accuracy on held-out prompts, over the ranks; --eval-samples k: mean@k, pass@j of k samples."""
    def n_correct(n: int, **kw) -> list[int]:  # correct completions of n a prompt, every rank's prompts
        mine = examples[rank::world]
        per_call = max(1, a.prompts_per_step // world * a.num_generations // n)  # the compiled sampler's rows
        counts = []
        for chunk in (mine[i:i + per_call] for i in range(0, len(mine), per_call)):
            rows = [{"record": ex} for ex in chunk for _ in range(n)]  # (--tools, --env: an episode each)
            generate(model, tok, rows, a, sampler=sampler, tools=tools, **kw)
            right = [is_correct(r["text"], r["record"]["answer"]) for r in rows]
            counts += [sum(right[j:j + n]) for j in range(0, len(right), n)]
        return sum(all_gather(counts), [])
    k = a.eval_samples
    with torch.random.fork_rng([model.device] if model.device.type == "cuda" else []):  # the run's untouched
        torch.manual_seed(a.seed + 1000 * rank + 999)
        out = {"eval/accuracy": statistics.fmean(n_correct(1, greedy=True))}
        if k:
            sampled = n_correct(k)
            out[f"eval/mean@{k}"] = sum(sampled) / (k * len(sampled))
            for j in sorted({k} | {2 ** e for e in range(1, k.bit_length())}):
                out[f"eval/pass@{j}"] = sum(pass_at_k(k, c, j) for c in sampled) / len(sampled)
    return out

def setup_distributed():
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if not dist.is_initialized():  # (parse_args makes it)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size(), device

def all_sum(x: torch.Tensor) -> torch.Tensor:  # torchrun: this and all_gather carry what the ranks share
    if dist.is_initialized():
        dist.all_reduce(x)
    return x

def all_gather(obj) -> list:  # [every rank's obj]
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out

def damaged(ckpt: str) -> str | None:  # its first file missing or cut (a copy cut short), by the sizes saved
    try:
        sizes = json.loads(pathlib.Path(ckpt, "grpo_args.json").read_text()).get("sizes", {})
    except (OSError, ValueError):
        return "grpo_args.json"
    now = {entry.name: entry.stat().st_size for entry in os.scandir(ckpt)}
    return next((name for name in sizes if now.get(name) != sizes[name]), None)

def last_checkpoint(output_dir: str, resume: str = "") -> str | None:
    """checkpoint/, else .old/ (whole if a save died between its renames); resume: required, damage named."""
    paths = [os.path.join(output_dir, "checkpoint"), os.path.join(output_dir, "checkpoint.old")]
    bad = [f"{path}/{damaged(path)}" for path in paths if os.path.isdir(path) and damaged(path)]
    ckpt = next((path for path in paths if os.path.isdir(path) and not damaged(path)), None)
    if resume and ckpt is None and (bad or resume == "on"):  # auto: none, where no save was made
        fail(f"--resume: {bad[0]} is missing or cut, and no other checkpoint is whole: restore it" if bad
             else f"--resume: no checkpoint in {output_dir!r}")
    if resume and bad and ckpt != paths[0]:
        print(f"grpo: {bad[0]} is missing or cut: resuming from {ckpt}", file=sys.stderr)
    return ckpt

def fingerprint(path: str, spread: bool = False, span: int = 1 << 26):
    """What --resume compares: a file's size and CRC-32 of its first and last `span` bytes (whole to 128 MiB);
    of a model dir, config.json and each weight file, one over 2 spans by 1,024 evenly spaced 4 KiB reads."""
    if os.path.isdir(path):
        return [fingerprint(os.path.join(path, name), True, span) for name in sorted(os.listdir(path))
                if name == "config.json" or name.endswith((".safetensors", ".bin"))]
    if not os.path.isfile(path):
        return path  # a hub id, or ''
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if spread and size > 2 * span:  # a fine-tune changes whole tensors: any over 1/1,024 is read in part
            crc = zlib.crc32(b"%d" % size)
            for i in range(1024):
                f.seek(i * size // 1024)
                crc = zlib.crc32(f.read(4096), crc)
            return crc
        head = f.read(span)
        f.seek(max(span, size - span))
        return zlib.crc32(b"%d %b %b" % (size, head, f.read()))

def save(model, tok, a: Args, state: dict):
    """Writes checkpoint.tmp/, swapped in by two renames: at every instant checkpoint/ or .old/ is whole."""
    if not all(p.isfinite().all() for p in model.parameters() if p.requires_grad):
        fail(f"the weights are not finite at step {state['step']}: nothing saved over the last checkpoint")
    final = os.path.join(a.output_dir, "checkpoint")
    shutil.rmtree(final + ".tmp", ignore_errors=True)  # a killed save's leftovers
    try:
        model.save_pretrained(final + ".tmp")
        tok.save_pretrained(final + ".tmp")
        with open(os.path.join(final + ".tmp", "trainer_state.pt"), "wb") as f:  # (to a path, it hides errno)
            torch.save(state, f)
        sizes = {e.name: e.stat().st_size for e in os.scandir(final + ".tmp") if e.name != "README.md"}
        files = {name: fingerprint(split_path(getattr(a, name))[0]) for name in PATHS}
        with open(os.path.join(final + ".tmp", "grpo_args.json"), "w") as f:
            json.dump({**vars(a), "step": state["step"], "sizes": sizes, "files": files}, f, indent=1)
    except Exception as e:  # a full disk, say (torch.save's a RuntimeError, safetensors' a SafetensorError)
        shutil.rmtree(final + ".tmp", ignore_errors=True)
        e = next((x for x in (e, e.__context__) if isinstance(x, OSError)), e)  # errno 28, under torch's
        fail(f"saving step {state['step']} failed ({' '.join(str(e).split())}); last checkpoint: "
             f"{last_checkpoint(a.output_dir) or 'none'}")
    if os.path.isdir(final):
        shutil.rmtree(final + ".old", ignore_errors=True)
        os.replace(final, final + ".old")
    os.replace(final + ".tmp", final)
    shutil.rmtree(final + ".old", ignore_errors=True)

def open_log(a: Args, name: str, step: int):
    path = os.path.join(a.output_dir, name)
    rows = []
    if a.resume and os.path.exists(path):
        with open(path) as f:
            rows = [row for row in f if row.endswith("}\n") and json.loads(row)["step"] <= step]
    pathlib.Path(path + ".tmp").write_text("".join(rows))
    os.replace(path + ".tmp", path)
    return open(path, "a", buffering=1)

def sample_rows(rows: list[dict], step: int) -> list[dict]:
    return [{"step": step, "prompt": r["record"]["prompt"], "completion": r["text"], "reward": r["reward"],
             "teacher": r["is_teacher"], "rewards": None if r["is_teacher"] else r["rewards"],
             "adv": r.get("adv"), "length": len(r["completion"]), "truncated": bool(r["truncated"]),
             "tool_calls": r["tool_calls"],
             "correct": is_correct(r["text"], r["record"]["answer"])} for r in rows]

STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)

def on_signal(run):
    """A signal of STOPS (USR1, USR2: time nearly up): rank 0 outside an update stops at once; else the step
    ends, is saved and the run stops; later ones are only noted: nothing breaks a save. Other ranks follow."""
    def handler(sig, frame):
        if run.stop:
            return
        run.stop = sig
        if run.rank == 0 and not run.busy:
            raise KeyboardInterrupt  # (not an Exception: a reward's `except Exception` cannot swallow it)
    for sig in STOPS:
        if signal.getsignal(sig) is not signal.SIG_IGN:  # under nohup, or a background job: stays ignored
            signal.signal(sig, handler)

LOCKS = {}  # output dir's .lock -> the file, locked from before the run in the dir is read till it ends

def lock_output(out: str, wait: bool = False):
    """One run per output dir, by a lock on its .lock; wait (--resume) for a run in it to end, else refuse."""
    path = os.path.join(os.path.abspath(out), ".lock")
    try:
        f = LOCKS.get(path) or open(path, "a")  # held since parse_args: locked again, a no-op
    except OSError:  # no dir yet (None), or not one we can write (check_output_dir says so)
        return None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        if not wait:
            fail(f"--output-dir {out!r} is in use by another run: wait for it, or stop it")
        print(f"grpo: --output-dir {out!r} is in use by another run: waiting for it to end", file=sys.stderr)
        fcntl.flock(f, fcntl.LOCK_EX)  # (Ctrl-C meanwhile: main says so, in one line)
    LOCKS[path] = f
    return f

def check_output_dir(a: Args):  # before anything loads
    if not (a.resume or a.overwrite):
        if last_checkpoint(a.output_dir) or os.path.isdir(os.path.join(a.output_dir, "checkpoint")):
            fail(f"--output-dir {a.output_dir!r} holds a run: --resume continues it, --overwrite starts over")
        log = pathlib.Path(a.output_dir, "metrics.jsonl")
        rows = log.exists() and [row for row in log.read_text().splitlines() if row.endswith("}")]
        if rows and json.loads(rows[-1])["step"]:  # a training step's: all that is left of a run never saved
            fail(f"--output-dir {a.output_dir!r} holds the metrics of a run that stopped before its first "
                 f"save: --overwrite starts over (deleting them), or give another --output-dir")
    out = pathlib.Path(a.output_dir).resolve()
    made = next(up for up in (out, *out.parents) if up.exists())  # out, or where it will be made
    try:  # a directory made and removed there (os.access says yes to root under /proc)
        os.rmdir(tempfile.mkdtemp(dir=made))
    except OSError:
        fail(f"--output-dir {a.output_dir!r} cannot be made: {str(made)!r} is not a directory we can write")
    for up in (out, *out.parents):  # (a run's saves replace its checkpoint dirs, beside its .lock)
        if up.name in ("checkpoint", "checkpoint.old", "checkpoint.tmp") and (up.parent / ".lock").exists():
            fail(f"--output-dir {a.output_dir!r} is inside a checkpoint of the run in {str(up.parent)!r}")

def start(a: Args):
    rank, world, device = setup_distributed()
    if a.prompts_per_step % world:
        fail(f"--prompts-per-step {a.prompts_per_step} must divide over {world} ranks (whole groups a rank)")
    check_output_dir(a)  # (rank 0 holds the dir's lock since parse_args)
    ckpt = last_checkpoint(a.output_dir)
    state = {"step": 0, "max_steps": a.max_steps, "prompts_drawn": 0}  # the run's memory (at_step)
    if a.resume:
        try:
            state = {**state, **torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)}
        except Exception as e:  # damaged at its saved size (zeros after a crash, say)
            fail(f"--resume: {ckpt}/trainer_state.pt cannot be read ({type(e).__name__}): restore it")
        if state["step"] >= a.max_steps:
            print(f"grpo: the run in {a.output_dir} is at step {state['step']}: raise --max-steps to go on")
            raise SystemExit(0)
        if len(state["rng"]) != world:
            fail(f"--resume: the saved run ran on {len(state['rng'])} processes, this one on {world}")
    reward_fns = build_rewards(a)
    train, evals = load_data(a, reward_fns)
    score([dict(record=train[0], text=t, completion=[0]) for t in (train[0]["answer"], "")],  # fails here
          [] if a.env else reward_fns, a)
    torch.manual_seed(a.seed)  # the same LoRA init on every rank
    model, tok, ref_model = load_model(a, device, ckpt if a.resume else None)
    pool = load_teacher_pool(a, train, tok) if a.teacher_pool else None
    tools = load_tools(a, tok, train + evals) if a.tools or a.env else None
    compiled = a.compile_generate == "on" or a.compile_generate == "auto" and device.type == "cuda"
    longest = longest_prompt(model, tok, a, train, evals, compiled, tools)  # one past the context fails
    rows = a.prompts_per_step // world * a.num_generations  # the sampler's shape (--tools: results too)
    sampler = compiled and make_sampler(model, a, longest + a.max_new_tokens * bool(tools), rows, True)
    opt = make_optimizer(a, model)
    torch.manual_seed(a.seed + 1000 * rank)  # sampling and teacher draws differ per rank, and repeat per run
    random.seed(a.seed + 1000 * rank)
    if a.resume:  # (the random states: restored here, saved anew as each step ends)
        opt.load_state_dict(state.pop("optimizer"))
        rng = state.pop("rng")[rank]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if rng["cuda"] is not None:
            torch.cuda.set_rng_state(rng["cuda"])
    stream = counted(prompt_stream(train, a.seed), state)  # where it left off
    from tqdm import tqdm
    steps = range(state["step"] + 1, a.max_steps + 1)
    bar = tqdm(steps, desc=a.algo, disable=rank > 0, initial=state["step"], total=a.max_steps)
    run = argparse.Namespace(  # state: the run's, live; done: it as the last step ended; saved: the last save
        rank=rank, world=world, device=device, model=model, tok=tok, ref_model=ref_model, opt=opt, bar=bar,
        sampler=sampler, reward_fns=reward_fns, pool=pool, evals=evals, stream=stream, start=state["step"],
        state=state, done=dict(state), saved=state["step"], flat=0, bad_steps=0, tools=tools)
    if rank == 0:
        open_output(run, a)
    return run

def open_output(run, a: Args):  # rank 0, once every check has passed: only now is the output dir written
    os.makedirs(a.output_dir, exist_ok=True)
    run.lock = lock_output(a.output_dir)  # one run per output dir, till it ends
    for name in ("checkpoint", "checkpoint.tmp", "checkpoint.old") if a.overwrite else ():
        shutil.rmtree(os.path.join(a.output_dir, name), ignore_errors=True)
    run.log = open_log(a, "metrics.jsonl", run.start)
    run.samples = open_log(a, "samples.jsonl", run.start)  # empty without --log-samples
    if a.wandb_project:
        import wandb
        wandb.init(project=a.wandb_project, config=dataclasses.asdict(a))

FLAT_STEPS = 5  # steps in a row whose groups all had equal rewards (run.flat: no reward signal) before a note

def end_step(run, a: Args, step: int, m: dict, generated: list[dict]) -> bool:
    if m.get("sampler/logp_gap", 0) > 0.25:  # the mean |sampler - trainer| log-prob gap
        fail(f"the sampler's log-probs are {m['sampler/logp_gap']:.3f} nat from the trainer's on average "
             f"(bf16 noise is a few hundredths): stale weights or a broken KV cache; --compile-generate off")
    run.bad_steps = run.bad_steps + 1 if "train/not_finite" in m else 0
    if run.bad_steps == 3:
        fail("3 steps in a row had a loss or gradient that was not finite; those updates were not applied: "
             "lower --learning-rate, or check the rewards with --log-samples")
    import copy
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    rng = {"torch": torch.get_rng_state(), "cuda": cuda, "python": random.getstate()}  # all a step draws from
    run.done = {**copy.deepcopy(run.state), "rng": all_gather(rng)}  # (a term may change it in place)
    stopping = bool(all_sum(torch.tensor([float(run.stop)], device=run.device)).item())
    firsts = sum(all_gather([r for r in generated if r["order"] < a.log_samples]), [])  # --log-samples K:
    samples = sample_rows(sorted(firsts, key=lambda r: r["order"]), step)  # the step's first K groups
    if run.rank != 0:
        return stopping
    m = {"step": step, **m, "tokens_per_second": m["completion/tokens"] / (time.time() - run.t0)}
    write_log(run, a, m, samples)
    if step == run.start + 1:  # a broken reward or chat template shows here, not an hour later
        for r in sample_rows(generated[:group_size(a)], step):  # its first group
            run.bar.write(f"grpo: reward {r['reward']:.3g} {r['rewards']}: {r['completion'][:50]!r}",
                          file=sys.stderr)
    run.flat = run.flat + 1 if m["groups/equal_frac"] == 1 or run.flat >= FLAT_STEPS else 0
    if run.flat == FLAT_STEPS:  # said once: past FLAT_STEPS, run.flat only grows
        run.bar.write(f"grpo: note: equal rewards in every group at steps {step - FLAT_STEPS + 1}-{step}, so "
                      "the rewards teach nothing: try a denser reward, a stronger model or easier prompts "
                      "(--log-samples 1 shows them)", file=sys.stderr)
    run.bar.set_postfix(reward=f"{m['reward/mean']:.3f}", acc=f"{m['accuracy']:.2f}")
    if (a.save_every and step % a.save_every == 0) or step == a.max_steps or stopping:
        save(run.model, run.tok, a, {**run.done, "optimizer": run.opt.state_dict()})
        run.saved = step
    return stopping

def write_log(run, a: Args, m: dict, samples=()):  # rank 0: a line of metrics.jsonl (and wandb's), samples
    try:
        run.log.write(json.dumps(m) + "\n")
        run.samples.writelines(json.dumps(r) + "\n" for r in samples)
    except OSError as e:  # a full disk, say
        fail(f"writing step {m['step']}'s metrics failed ({e}); last checkpoint: "
             f"{last_checkpoint(a.output_dir) or 'none'}")
    if a.wandb_project:
        sys.modules["wandb"].log(m, step=m["step"])

def describe(a: Args) -> str:
    """--dry-run: the loss the flags optimise, each term's words (probe: no model or data), then the flags."""
    w = probe(a)[2]
    G = group_size(a)
    shaping = f" + overlong(L_cache={a.overlong_buffer})" if a.overlong_penalty else ""  # a reward of its own
    reward = " + ".join(filter(None, [a.rewards.replace(",", " + "), a.reward_fn])) + shaping
    norm = aggregate_loss(torch.ones(1, 1), torch.ones(1, 1), a.loss_agg, a.max_new_tokens)[1]
    split = edit_source_grads({}, [], a)[1]
    lines = [f"loss = {norm},  Σ_t over m_i,t = {w['m']}{split}", f"  ℓ_i,t = {w['ℓ']},  r = {w['r']}",
             f"  π_old = {w['π_old']}", f"  A_i = {w['A']}", f"  R_i = {reward}{w['R']}",
             f"  o_1..{G} ~ π_old(·|q), {a.teacher_per_group} of them from the pool (R frozen), temp. "
             f"{a.temperature:g}, top-p {a.top_p:g}, top-k {a.top_k}, |o_i| ≤ {a.max_new_tokens}; "
             f"{draw(itertools.repeat({'prompt': '', 'answer': ''}), a, {})[1]}",
             f"  groups trained: {select_groups(torch.arange(G)[None].float(), a)[2]}; those of equal "
             f"rewards {w['equal']}"]
    flags = " ".join(f"{dash(k)} {v!r}" for k, v in vars(a).items())
    return "\n".join(lines + ["", textwrap.fill(flags, 100)])

def main(argv=None):
    run = argparse.Namespace(stop=0, rank=0, busy=False)  # on_signal reads it; start() fills in the rest
    on_signal(run)
    try:
        a = parse_args(argv)
        if a.dry_run:
            return print(describe(a))
        vars(run).update(vars(start(a)))
    except KeyboardInterrupt:  # a signal while it starts, or waits for the lock: nothing to save
        print("grpo: stopped while starting: nothing saved", file=sys.stderr)
        raise SystemExit(128 + (run.stop or signal.SIGINT))
    try:
        if a.eval_every and run.evals and run.start == 0:  # where the run starts from, as papers report it
            m = evaluate(run.model, run.tok, run.evals, a, run.rank, run.world, run.sampler, run.tools)
            if run.rank == 0:
                write_log(run, a, {"step": 0, **m})
        for step in run.bar:
            run.busy = False  # till the update, a signal stops the run at once
            if run.stop and run.rank == 0:  # one that came as the last step was saved
                raise KeyboardInterrupt
            run.t0 = time.time()
            t = at_step(a, run.state, step)  # the flags as this step uses them
            rows, m, generated = rollout(run.model, run.tok, run.stream, run.reward_fns, run.pool, t,
                                           run.state, run.sampler, run.rank, run.world, run.tools)
            run.busy = True  # from here to the end of the step (or of the run), a signal waits for it
            t1 = time.time()
            for g in run.opt.param_groups:
                g["lr"] = m["lr"] = t.learning_rate
            if m["groups/kept"]:  # the same on every rank; 0 when dynamic sampling kept nothing by its cap
                m.update(train_step(run.model, run.ref_model, run.opt, rows, t, run.state))
            m["time/train"] = time.time() - t1
            if a.eval_every and run.evals and (step % a.eval_every == 0 or step == a.max_steps):
                m.update(evaluate(run.model, run.tok, run.evals, t, run.rank, run.world, run.sampler,
                                  run.tools))
            if end_step(run, a, step, m, generated):
                break
    except BaseException as e:  # a signal outside an update (KeyboardInterrupt), or an error
        save_last_step(run, a, e)
    finish(run, a)

def save_last_step(run, a: Args, e: BaseException):
    """A signal or an error (a reward, a record, the sampler) outside an update saves the last completed step
    (the weights'); an error inside one, its evaluation, log or save, or diverged logits, save nothing."""
    if isinstance(e, KeyboardInterrupt) and not run.stop:  # no signal raised it (a reward?): an error, exit 1
        e = RuntimeError("the KeyboardInterrupt above came from no signal: an error")
    if run.rank == 0 and not run.busy and run.done["step"] > run.saved and "logits are not" not in str(e):
        try:
            save(run.model, run.tok, a, {**run.done, "optimizer": run.opt.state_dict()})
        except SystemExit as failed:  # it failed too (a full disk, say): after the error that stopped the run
            if not isinstance(e, (SystemExit, KeyboardInterrupt)):  # (a traceback)
                sys.excepthook(type(e), e, e.__traceback__)
            raise SystemExit(f"{e.code}\n{failed.code}" if isinstance(e, SystemExit) else failed.code)
        run.saved = run.done["step"]
        if isinstance(e, SystemExit) and isinstance(e.code, str):  # one line: the error, and what was saved
            e = SystemExit(f"{e.code} (step {run.saved} saved: --resume continues)")
        elif not isinstance(e, KeyboardInterrupt):
            where = f"{a.output_dir}/checkpoint"
            print(f"grpo: step {run.saved} saved in {where}: --resume continues; the error:", file=sys.stderr)
    if not isinstance(e, KeyboardInterrupt):
        raise e

def finish(run, a: Args):
    if run.busy and dist.is_initialized():  # (busy: every rank is at the end of a step, none in a collective)
        dist.barrier()  # ranks leave together, after rank 0's last save (one leaving sooner may die at exit)
        dist.destroy_process_group()
    finished = run.done["step"] == a.max_steps  # (a signal during the last save changes nothing)
    where = f"{a.output_dir}/checkpoint; metrics in {a.output_dir}/metrics.jsonl"
    if run.rank == 0 and (finished or not run.stop):
        print(f"grpo: step {run.done['step']} saved in {where}")
    elif run.rank == 0 and run.done["step"]:
        print(f"grpo: stopped at step {run.done['step']}: --resume to continue ({where})")
    elif run.rank == 0:
        print("grpo: stopped before step 1 ended: nothing saved")
    for f in (LOCKS.pop(run.lock.name), run.log, run.samples) if run.rank == 0 else ():  # (for a caller that
        f.close()  # runs main() again in this process)
    if run.stop and not finished:
        raise SystemExit(128 + run.stop)

if __name__ == "__main__":
    try:
        main()
    finally:  # a late signal must not kill the exit: Python gives a handled one its default action as it ends
        for sig in STOPS:
            signal.signal(sig, signal.SIG_IGN)
