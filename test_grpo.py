"""Tests for grpo.py and rewards.py, on a CPU in a few minutes. Nothing is downloaded: a tiny Qwen2 model and
tokenizer are built locally (tiny.py) and loaded through the real loading code.

In tiers, as the file reads: the math against hand-computed values; the rewards; flags and data; the tiny
model in-process (gradients, log-probs, sampling); then whole runs of grpo.py, in-process where they can be
and as a subprocess where a signal, torchrun or a fresh interpreter is what is tested."""
import argparse
import collections
import contextlib
import copy
import decimal
import errno
import fcntl
import inspect
import itertools
import json
import math
import os
import pathlib
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import replace

# One thread a process: with `-n 2` on 2 cores, and torchrun's ranks beside them, more OpenMP threads than
# cores spin against each other (the suite took 5 min 26 s on 2 cores with torch's default, 1 min 36 s so).
os.environ.setdefault("OMP_NUM_THREADS", "1")  # (before torch is imported; subprocesses inherit it)
import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import grpo
import rewards as R
import tiny

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = ["--max-new-tokens", "12", "--prompts-per-step", "2", "--num-generations", "4", "--eval-prompts", "4",
        "--eval-every", "2", "--micro-batch-size", "3", "--learning-rate", "1e-3"]
NO_EVAL = TINY[:6] + TINY[10:]  # for a --dataset without an --eval-dataset, where evaluation flags are refused
TIMING = ("time/", "tokens_per_second")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tiny.make_tiny(str(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="session")
def loaded(tiny_dir):
    a = grpo.parse_args(["--model", tiny_dir, "--algo", "drgrpo"] + TINY)
    model, tok, _ = grpo.load_model(a, torch.device("cpu"))
    return a, model, tok


@pytest.fixture(scope="session")
def loaded_bf16(tiny_dir):
    a = grpo.parse_args(["--model", tiny_dir, "--algo", "drgrpo", "--dtype", "bf16"] + TINY)
    model, tok, _ = grpo.load_model(a, torch.device("cpu"))
    return a, model, tok


@pytest.fixture(scope="session")
def wide_dir(tmp_path_factory):
    """Qwen2.5-0.5B's vocabulary width (151,936 logits a token) on a small body: the width is what it tests."""
    return tiny.make_tiny(str(tmp_path_factory.mktemp("wide") / "model"), layers=1, hidden=64, vocab=151936)


@pytest.fixture(scope="session")
def eos_dir(tmp_path_factory):
    """The tiny model with several EOS ids in its generation config, as Qwen2.5-Instruct's lists <|im_end|> and
    <|endoftext|> where its tokenizer names one; here 20 byte tokens too (bytes above 160, never in ASCII text), so
    that sampled completions end at varied lengths, most of them before T = 12."""
    from transformers import AutoTokenizer, GenerationConfig
    path = tiny.make_tiny(str(tmp_path_factory.mktemp("eos") / "model"))
    tok = AutoTokenizer.from_pretrained(path)
    high = [i for i, t in enumerate(tok.convert_ids_to_tokens(list(range(len(tok))))) if "¡" <= t <= "ÿ"][:20]
    assert len(high) == 20 and tok.eos_token == "<|im_end|>"
    eos = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]) + high
    GenerationConfig(eos_token_id=eos).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tools_dir(tmp_path_factory):
    """The tiny model with a chat template that renders tools as Qwen2.5-Instruct's does (tiny.TOOLS_CHAT_TEMPLATE)."""
    return tiny.make_tiny(str(tmp_path_factory.mktemp("tools") / "model"), chat_template=tiny.TOOLS_CHAT_TEMPLATE)


@pytest.fixture(scope="session")
def tools_loaded(tools_dir):
    a = grpo.parse_args(["--model", tools_dir, "--algo", "drgrpo", "--tools", "calculator"] + TINY)
    model, tok, _ = grpo.load_model(a, torch.device("cpu"))
    return a, model, tok, grpo.load_tools(a, tok)

@pytest.fixture(autouse=True)
def signal_handlers():
    """grpo.main() installs its own handlers of grpo.STOPS (and tests an alarm): none is left behind; nor is the
    lock on an output dir of a run that failed in this process (a process that ends lets it go)."""
    saved = {s: signal.getsignal(s) for s in (*grpo.STOPS, signal.SIGALRM)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)
    while grpo.LOCKS:
        grpo.LOCKS.popitem()[1].close()


def main(argv, cwd=None):
    """grpo.py's main() in this process (a run of the tiny model costs seconds, not an interpreter's start)."""
    here = os.getcwd()
    os.chdir(cwd or here)
    try:
        grpo.main(argv)
    finally:
        os.chdir(here)


def cli(args, check=True, timeout=300, cmd=(sys.executable,), cwd=HERE, **kw):
    """grpo.py as a subprocess: for signals, torchrun, and what only a fresh interpreter shows."""
    p = subprocess.run(list(cmd) + [os.path.join(HERE, "grpo.py")] + args, cwd=cwd, capture_output=True,
                       text=True, timeout=timeout, **kw)
    if check and p.returncode != 0:
        raise AssertionError(p.stdout[-3000:] + p.stderr[-3000:])
    return p


def metrics(out_dir, with_step_0=False):
    """metrics.jsonl's rows; step 0, the evaluation before training, only when asked."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["step"] or with_step_0]


def steady(rows):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def trained(out):
    from safetensors.torch import load_file
    return load_file(os.path.join(out, "checkpoint", "adapter_model.safetensors"))


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def reward_file(tmp_path, body="def digits(c, a, **kw):\n    return sum(ch.isdigit() for ch in c) / 10\n"):
    """A dense reward, so that a random tiny model sees differing rewards (and gradients) in every group."""
    (tmp_path / "rw.py").write_text(body)
    name = body.split("def ")[-1].split("(")[0]
    return ["--reward-fn", f"{tmp_path}/rw.py:{name}", "--rewards", "correct"]


# ============================================================================= tier 1: the math, by hand
def test_group_advantages_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 5.0]])
    # group 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3); group 2: mean 2.75, std sqrt((3*.5625 + 5.0625)/3)
    s1, s2 = math.sqrt(1 / 3), math.sqrt((3 * 0.5625 + 5.0625) / 3)
    want_std = torch.tensor([[0.5 / s1, -0.5 / s1, -0.5 / s1, 0.5 / s1],
                             [-0.75 / s2, -0.75 / s2, -0.75 / s2, 2.25 / s2]])
    assert torch.allclose(grpo.group_advantages(r, "std", eps=0)[0], want_std, atol=1e-6)
    want_none = torch.tensor([[0.5, -0.5, -0.5, 0.5], [-0.75, -0.75, -0.75, 2.25]])
    assert torch.allclose(grpo.group_advantages(r, "none")[0], want_none)
    assert torch.equal(grpo.group_advantages(torch.ones(1, 4), "std")[0], torch.zeros(1, 4))  # no 0/0


def test_soft_weights_by_hand():
    w = grpo.soft_weights(torch.tensor([0.5, 0.25, 0.0]), eps=0)
    assert torch.allclose(w, torch.tensor([1.0, 0.5, 0.0]))
    assert torch.allclose(grpo.soft_weights(torch.tensor([[0.5], [1.0]]), eps=0), torch.tensor([[0.5], [1.0]]))


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize("mode, want", [
    ("token-mean", (1 + 2 + 4) / 3),                  # all tokens of the batch
    ("seq-mean-token-mean", ((1 + 2) / 2 + 4 / 1) / 2),  # per sequence, then over sequences
    ("seq-mean-token-sum", ((1 + 2) + 4) / 2),
    ("seq-mean-token-sum-norm", ((1 + 2) + 4) / (2 * 4)),  # / (n_seq * T), T = 4
])
def test_aggregate_loss_by_hand(mode, want):
    assert grpo.aggregate_loss(LOSS, MASK, mode, max_len=4)[0].item() == pytest.approx(want)


@pytest.mark.parametrize("mode", grpo.LOSS_AGGS)
def test_non_finite_values_past_the_mask_do_not_leak(mode):
    """A NaN or inf at a masked position (e.g. k3 past EOS, exp(ref - logp) overflowing) changes neither the
    loss nor the gradient of the positions that count."""
    w = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], requires_grad=True)
    bad = w + torch.tensor([[0.0, 0.0, math.inf], [0.0, math.nan, 0.0]])
    loss = grpo.aggregate_loss(bad, MASK, mode, max_len=4)[0]
    g, = torch.autograd.grad(loss, w)
    want = grpo.aggregate_loss(w, MASK, mode, max_len=4)[0]
    assert loss.item() == pytest.approx(want.item()) and torch.isfinite(g).all()
    assert torch.equal(g, torch.autograd.grad(want, w)[0])


@pytest.mark.parametrize("mode", grpo.LOSS_AGGS)
def test_aggregate_loss_micro_batches_sum_to_full_batch(mode):
    """With the step's normalisers passed in, micro-batch losses (hence gradients) add up to the full one."""
    torch.manual_seed(0)
    w = torch.randn(6, 5, requires_grad=True)
    mask = (torch.rand(6, 5) > 0.3).float()
    mask[2] = 0  # a sequence with no loss token counts in no normaliser
    full = grpo.aggregate_loss(w ** 2, mask, mode, 5)[0]
    g_full, = torch.autograd.grad(full, w)
    n_seqs, n_tokens = (mask.sum(-1) > 0).sum(), mask.sum()
    parts = sum(grpo.aggregate_loss(w[i:i + 2] ** 2, mask[i:i + 2], mode, 5, n_seqs, n_tokens)[0] for i in (0, 2, 4))
    g_parts, = torch.autograd.grad(parts, w)
    assert parts.item() == pytest.approx(full.item())
    assert torch.allclose(g_parts, g_full)


def loss_args(**kw):
    return grpo.Args(eps_low=0.2, eps_high=0.28, **kw)


def test_dual_clip_is_the_ratio_clamped_at_c_when_c_clears_the_clip_range():
    # INTELLECT-2's two-sided clip, written apart: where A < 0, -min(min(r, c) A, clip(r) A)
    r = torch.linspace(0.1, 6.0, 300)[None]
    adv = -torch.ones(1, 300)
    for c, same in ((1.28, True), (3.0, True), (1.2, False)):
        two_sided = -torch.min(torch.clamp(r, max=c) * adv, torch.clamp(r, 0.8, 1.28) * adv)
        loss, _, _ = grpo.policy_loss(r.log(), torch.zeros_like(r), adv, torch.ones_like(r), loss_args(dual_clip=c))
        assert torch.allclose(loss, two_sided, atol=1e-6) == same


def test_clipped_surrogate_by_hand():
    ratio = torch.tensor([[1.5, 0.5, 0.5, 1.5, 1.1]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 1.0]])
    ones = torch.ones_like(ratio)
    loss, diag, _ = grpo.policy_loss(ratio.log(), torch.zeros_like(ratio), adv, ones, loss_args())
    # -min(r A, clip(r, 0.8, 1.28) A), term by term
    want = torch.tensor([[-1.28, 0.8, -0.5, 1.5, -1.1]])
    assert torch.allclose(loss, want, atol=1e-6)
    assert diag["loss/clipfrac_low"].tolist() == [[False, True, False, False, False]]
    assert diag["loss/clipfrac_high"].tolist() == [[True, False, False, False, False]]
    assert torch.allclose(diag["loss/ratio"], ratio) and "loss/dual_clipfrac" not in diag
    # dual-clip c = 1.4 binds where A < 0 and r > c: the 4th token (r 1.5), whose loss becomes c |A|
    loss, diag, _ = grpo.policy_loss(ratio.log(), torch.zeros_like(ratio), adv, ones, loss_args(dual_clip=1.4))
    assert diag["loss/dual_clipfrac"].tolist() == [[False, False, False, True, False]]
    assert torch.allclose(loss, torch.tensor([[-1.28, 0.8, -0.5, 1.4, -1.1]]), atol=1e-6)
    # clipped tokens carry no gradient, unclipped ones carry -A * r
    logp = ratio.log().requires_grad_()
    grpo.policy_loss(logp, torch.zeros_like(logp), adv, ones, loss_args())[0].sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[0.0, 0.0, -0.5, 1.5, -1.1]]), atol=1e-6)


LOSSES = [dict(), dict(ratio="sequence"), dict(surrogate="cispo"), dict(surrogate="sapo"), dict(dual_clip=3.0),
          dict(ratio="sequence", surrogate="sapo"), dict(ratio="sequence", surrogate="cispo", dual_clip=2.0)]


@pytest.mark.parametrize("kw", LOSSES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "clip")
def test_every_loss_has_the_policy_gradient_on_policy(kw):
    """num_iterations 1 (old_logp = logp.detach(), r = 1): each loss's gradient is -A grad log pi per token,
    what people keep asking; a padded position gets none."""
    torch.manual_seed(0)
    logp = (-torch.rand(3, 4) * 3).requires_grad_()
    adv = torch.tensor([[1.5], [-0.7], [0.3]])
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    loss, _, _ = grpo.policy_loss(logp, logp.detach(), adv, mask, loss_args(**kw))
    g, = torch.autograd.grad((loss * mask).sum(), logp)
    assert torch.allclose(g, -adv * mask, atol=1e-6)


def test_each_loss_off_policy_by_hand():
    """r != 1 (num_iterations > 1): each formula's own gradient wrt logp, computed by hand; the summed
    loss last."""
    def grad(logp_minus_old, adv, mask=None, **kw):
        logp = torch.tensor([logp_minus_old]).requires_grad_()
        mask = torch.ones_like(logp) if mask is None else torch.tensor([mask])
        loss, _, _ = grpo.policy_loss(logp, torch.zeros_like(logp), torch.tensor([[adv]]), mask, loss_args(**kw))
        return torch.autograd.grad((loss * mask).sum(), logp)[0][0].tolist() + [(loss * mask).sum().item()]
    r = 1.5  # above 1 + eps_high = 1.28, A = 1
    assert grad([math.log(r)], 1.0) == pytest.approx([0.0, -1.28])  # clip: flat, no gradient
    assert grad([math.log(r)], 1.0, surrogate="cispo") == pytest.approx([-1.28, -1.28 * math.log(r)])
    s = 1 / (1 + math.exp(-(r - 1)))  # sapo, tau_pos = 1: d/dlogp -(4/tau) sigmoid(tau (r-1)) = -4 s (1-s) r
    assert grad([math.log(r)], 1.0, surrogate="sapo") == pytest.approx([-4 * s * (1 - s) * r, -4 * s])
    s = 1 / (1 + math.exp(-1.05 * (r - 1)))  # A < 0: tau_neg = 1.05, loss +(4/1.05) s, gradient +4 s (1-s) r
    assert grad([math.log(r)], -1.0, surrogate="sapo") == pytest.approx([4 * s * (1 - s) * r, 4 / 1.05 * s])
    r = 4.0  # A = -1: clip loss -min(-4, -1.28) = 4 with gradient r; dual clip caps it at c |A| = 3, flat
    assert grad([math.log(r)], -1.0) == pytest.approx([4.0, 4.0])
    assert grad([math.log(r)], -1.0, dual_clip=3.0) == pytest.approx([0.0, 3.0])
    assert grad([math.log(2.0)], -1.0, dual_clip=3.0) == pytest.approx([2.0, 2.0])  # under the cap: unchanged
    r = 1.25  # inside [0.8, 1.28]: a c below 1 + eps_high caps the loss there too, where r clamped at c would not
    assert grad([math.log(r)], -1.0, dual_clip=1.2) == pytest.approx([0.0, 1.2])
    # GSPO: log r = 0.1 and 0.3 (a third position padded) -> s = e^0.2 = 1.2214 < 1.28. The loss is -A s at
    # both tokens and d s / d logp_t = s / 2, so each token's gradient is -A s. Token ratios: -A e^0.1, and
    # e^0.3 = 1.35 is clipped (0)
    s = math.exp(0.2)
    assert grad([0.1, 0.3, 5.0], 1.0, [1.0, 1.0, 0.0], ratio="sequence") == pytest.approx([-s, -s, 0, -2 * s])
    assert grad([0.1, 0.3, 5.0], 1.0, [1.0, 1.0, 0.0])[:3] == pytest.approx([-math.exp(0.1), 0, 0])
    assert grad([0.2, 0.4], 1.0, ratio="sequence")[:2] == [0.0, 0.0]  # s = e^0.3 = 1.35 > 1.28: all clipped


def test_kl_k3_by_hand_and_unbiased():
    assert grpo.kl_penalty(torch.tensor(math.log(0.5)), torch.tensor(math.log(0.25))).item() == pytest.approx(
        0.5 - math.log(0.5) - 1)
    # E_{x~pi}[k3(x)] = KL(pi || ref) exactly, over a categorical
    pi, ref = torch.tensor([0.1, 0.2, 0.7]), torch.tensor([0.3, 0.3, 0.4])
    expectation = (pi * grpo.kl_penalty(pi.log(), ref.log())).sum()
    assert expectation.item() == pytest.approx((pi * (pi / ref).log()).sum().item(), rel=1e-6)


@pytest.mark.parametrize("kind, direction", [("k3", "ref||pi"), ("k3_ratio", "pi||ref"), ("k2", "pi||ref")])
def test_kl_gradient_monte_carlo(kind, direction):
    """The mean gradient of each estimator over samples x ~ pi, against the exact gradient of the KL in the
    direction its docstring names, on a categorical policy pi = softmax(theta)."""
    torch.manual_seed(0)
    theta = torch.tensor([0.5, -1.0, 1.2, 0.0, -0.3], requires_grad=True)
    ref = torch.tensor([0.1, 0.4, 0.1, 0.3, 0.1])
    pi = theta.softmax(0)
    exact = {"pi||ref": (pi * (pi.log() - ref.log())).sum(), "ref||pi": (ref * (ref.log() - pi.log())).sum()}
    want = {k: torch.autograd.grad(v, theta, retain_graph=True)[0] for k, v in exact.items()}
    x = torch.multinomial(pi.detach(), 400_000, replacement=True)
    logp = theta.log_softmax(0)[x]
    got, = torch.autograd.grad(grpo.kl_penalty(logp, ref.log()[x], kind).mean(), theta)
    other = "pi||ref" if direction == "ref||pi" else "ref||pi"
    assert (want[direction] - want[other]).abs().max() > 0.2  # the two directions differ here
    assert torch.allclose(got, want[direction], atol=0.02), (got, want)


@pytest.mark.parametrize("n, c, k", [(5, 0, 1), (5, 2, 1), (5, 2, 2), (6, 3, 4), (8, 1, 8), (8, 7, 2), (4, 4, 3)])
def test_pass_at_k_against_enumeration(n, c, k):
    """The unbiased estimator equals the share of k-subsets of the n samples holding a correct one, and Chen et
    al.'s numerically stable product form 1 - prod_{i=n-c+1}^{n} (1 - k / i)."""
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    assert grpo.pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    assert grpo.pass_at_k(n, c, k) == pytest.approx(1 - math.prod(1 - k / i for i in range(n - c + 1, n + 1))
                                                    if n - c >= k else 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_k3_ratio_gradient_is_exactly_minus_d(dtype):
    """k3_ratio's gradient at ratio 1 is -d, d = ref - logp (TRL's and verl's "k3+" gradient), for any |d|:
    differentiated as (1 - e^d) + (e^d - d - 1) it was 0 at d = 22 in fp32 and -32 at d = 40 in fp64."""
    for d in [-40.0, -22.0, -5.0, -0.5, 0.5, 5.0, 17.0, 22.0, 30.0, 40.0]:
        logp = torch.tensor([-3.0], dtype=dtype, requires_grad=True)
        value = grpo.kl_penalty(logp, logp.detach() + d, "k3_ratio")
        value.backward()
        assert logp.grad.item() == -d
        assert value.item() == pytest.approx(math.exp(d) - d - 1, rel=1e-6)


def test_k3_ratio_is_weighted_by_the_policy_ratio_off_policy():
    """After the first inner update (num_iterations > 1) the weight is pi / pi_old: value r k3, gradient -r d."""
    logp, old, ref = torch.tensor([-1.0], requires_grad=True), torch.tensor([-1.5]), torch.tensor([-2.0])
    value = grpo.kl_penalty(logp, ref, "k3_ratio", old)
    value.backward()
    r, d = math.exp(0.5), -1.0
    assert value.item() == pytest.approx(r * (math.exp(d) - d - 1)) and logp.grad.item() == pytest.approx(-r * d)


# ----------------------------------------------------------------------------- the step: advantages and masks
def step(a, reward, mask=None, state=None, **inputs):
    """step_terms on one process's rows: rewards (M,), groups of G = a.num_generations rows; a mask of 3 tokens
    a row unless given; the run's state (a fresh one unless given); inputs: what a term reads (old_logp,
    ref_logp, old_entropy, per_fn, truncated)."""
    reward = torch.as_tensor(reward, dtype=torch.float64)
    mask = torch.ones(len(reward), 3, dtype=torch.float64) if mask is None else torch.as_tensor(mask).double()
    s = dict(reward=reward, mask=mask, truncated=torch.zeros(len(reward), dtype=torch.bool),
             is_teacher=torch.zeros(len(reward), dtype=torch.bool), sampler_logp=torch.zeros_like(mask),
             per_fn=reward[:, None])
    made, stats, words = grpo.step_terms({**s, **inputs}, a, {} if state is None else state)
    return made["adv"], made["row_adv"][:, 0], made["loss_mask"], made["keep"], made["flat"][:, 0], stats, words


def test_top_entropy_quantile_with_no_token_left_to_train_trains_nothing():
    """--mask-truncated on a step whose completions were all cut at T leaves no token: the quantile of nothing
    was a crash (torch.quantile of an empty tensor); now the step trains nothing, as without the flag."""
    a = grpo.Args(num_generations=2, top_entropy_quantile=0.5, mask_truncated=True)
    adv, row_adv, mask, *_ = step(a, [1.0, 0.0], old_entropy=torch.rand(2, 3).double(),
                                  truncated=torch.ones(2, dtype=torch.bool))
    assert not mask.any() and torch.isfinite(adv).all() and row_adv.abs().min() > 0.5


def test_top_entropy_keeps_the_tokens_at_or_above_the_step_s_quantile_by_hand():
    """80/20 (2506.01939): A_i,t = A_i 1[H_i,t >= the (1 - rho) quantile of the trained tokens' entropies], with
    torch.quantile's linear interpolation, ties at the threshold kept; padding is not among the tokens."""
    a = grpo.Args(num_generations=2, scale="none", top_entropy_quantile=0.4)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    H = torch.tensor([[0.5, 2.0, 1.0, 3.0], [2.0, 0.1, 9.0, 9.0]], dtype=torch.float64)  # 9.0: padding
    # the 6 trained entropies sorted: 0.1 0.5 1.0 2.0 2.0 3.0; the 0.6 quantile sits at (6 - 1) * 0.6 = 3: 2.0,
    # and both 2.0s are kept (3 of 6 tokens, more than rho of them). With the padding's 9s it would be 2.2.
    adv, row_adv, m, keep, _, stats, _ = step(a, [1.0, 0.0], mask, old_entropy=H)
    assert row_adv.tolist() == [0.5, -0.5] and torch.equal(m, mask.double())  # the normalisers as they were
    assert (adv * mask).tolist() == [[0, 0.5, 0, 0.5], [-0.5, 0, 0, 0]] and torch.equal(keep, adv != 0)
    assert stats["loss/low_entropy_frac"] == 0.5  # 3 of the 6 tokens dropped
    adv, _, _, _, _, stats, _ = step(replace(a, top_entropy_quantile=0.0), [1.0, 0.0], mask, old_entropy=H)
    assert (adv * mask).tolist() == [[0, 0, 0, 0.5], [0, 0, 0, 0]]  # rho 0: the max, 3.0
    assert stats["loss/low_entropy_frac"] == 5 / 6
    adv, *_ = step(replace(a, top_entropy_quantile=1.0), [1.0, 0.0], mask)  # off: reads no entropy
    assert adv.shape == (2, 1)


def test_top_entropy_takes_the_quantile_of_a_step_past_torch_quantile_s_limit():
    """torch.quantile refuses over 2^24 elements (64 prompts x 16 completions x 16k tokens): the step's quantile
    is torch.quantile's rule written out. Two rows of 2^23 + 1 tokens, entropies 0..2^24 + 1 (float64): the 0.5
    quantile sits at (2^24 + 1) / 2 = 8388608.5, so the tokens of entropy 8388609 and up are kept."""
    n = 2 ** 23 + 1
    H = torch.arange(2 * n, dtype=torch.float64).view(2, n)
    adv, *_ = step(grpo.Args(num_generations=2, scale="none", top_entropy_quantile=0.5), [1.0, 0.0],
                   torch.ones(2, n), old_entropy=H)
    kept = adv != 0
    assert kept.sum() == n and kept[1].all() and not kept[0].any()  # row 1 holds 8388609 ... 16777217


# ----------------------------------------------------------------------------- the token objective
def peer_inputs():
    """The inputs of the peer values quoted below (TRL 1.16.0 and verl 0.9.1, their own functions run on them),
    regenerated by the seeded calls that made them, bitwise: N = 4 rows of 5, 3, 4 and 1 tokens, float32 values
    in float64; pi_old / pi ~ e^(0.35 noise); the sampler off pi_old by [.3, .3, -.2, .05] a row plus noise,
    pi_old / pi_sampler ~ 3.7 at [0, 2] and ~ 0.35 at [2, 1]; the 7th and 8th of 13 entropies tied (the median)."""
    g = torch.Generator().manual_seed(0)
    f64 = torch.float64
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]], dtype=f64)
    logp = -(torch.rand(4, 5, generator=g, dtype=f64) * 2 + 0.05)
    old = logp + 0.35 * torch.randn(4, 5, generator=g, dtype=f64)
    offset = torch.tensor([[0.3], [0.3], [-0.2], [0.05]], dtype=f64)
    sampler = old + offset + 0.1 * torch.randn(4, 5, generator=g, dtype=f64)
    sampler[0, 2] -= 1.6
    sampler[2, 1] += 1.2
    ref = logp + 0.5 * torch.randn(4, 5, generator=g, dtype=f64)
    entropy = torch.rand(4, 5, generator=g, dtype=f64) * 3
    logp, old, sampler, ref, entropy = (x.float().double() for x in (logp, old, sampler, ref, entropy))
    where = mask.bool().nonzero()
    order = entropy[mask.bool()].argsort()
    entropy[tuple(where[order[7]])] = entropy[tuple(where[order[6]])]
    assert logp[0, 0].item() == -1.9901059865951538  # torch's generator draws what it drew for the peers
    return dict(mask=mask, loss_mask=mask, keep=mask > 0, logp=logp, old_logp=old, sampler_logp=sampler, ref_logp=ref, entropy=entropy,
                adv=torch.tensor([[1.2], [-0.7], [0.5], [-1.5]], dtype=f64))


def objective(x, agg="token-mean", **kw):
    """token_objective, then aggregate_loss (T = C), on x (peer_inputs' keys), off-policy: num_iterations 2, so
    pi_old is x's old_logp. The loss and its gradients with respect to logp and the entropy."""
    logp = x["logp"].clone().requires_grad_()
    entropy = x["entropy"].clone().requires_grad_()
    loss, _, _ = grpo.token_objective(logp, entropy, x, grpo.Args(num_iterations=2, **kw))
    total = grpo.aggregate_loss(loss, x["mask"], agg, x["mask"].shape[1])[0]
    g_logp, g_entropy = torch.autograd.grad(total, [logp, entropy], allow_unused=True)
    return total.item(), g_logp, torch.zeros_like(entropy) if g_entropy is None else g_entropy


def token_mean(diag, mask, key):  # a diagnostic as train_step logs it: its mean over the trained tokens
    return torch.where(mask > 0, diag[key], 0).sum().item() / (mask > 0).sum().item()


def near(got, want, atol=1e-9):  # the peers' gradients below are rounded to 10 decimals
    return torch.allclose(got, torch.tensor(want, dtype=got.dtype), rtol=0, atol=atol)


def test_opsm_drops_negative_rows_whose_sampler_drifted_past_delta_by_hand():
    """DeepSeek-V3.2 (2512.02556) eq. 9: no policy loss where A_i < 0 and mean_t log pi_sampler / pi_theta >
    delta: the current pi_theta, the mean over o_i's tokens, equal to delta kept; a teacher row (no sampler)
    measured by pi_old (TRL's fallback). delta = 0.5, logp = -1 everywhere."""
    nan = math.nan
    mask = torch.tensor([[1.0, 1, 1]] * 3 + [[1, 0, 0]] + [[1, 1, 1]] * 2)
    sampler = torch.tensor([[-0.5] * 3, [-0.25, -0.5, -0.5], [-0.25, -0.5, -0.5], [-0.4, 5, 5], [nan] * 3, [nan] * 3])
    old = torch.tensor([[-1.5] * 3, [-1.0] * 3, [-1.0] * 3, [-1.0] * 3, [-0.2] * 3, [-1.0] * 3])
    # drift: 0.5 = delta (kept; from pi_old it would be 1.0), 1.75 / 3 > delta, the same with A > 0 (kept), 0.6
    # over |o_i| = 1 token (over C it would be 0.2), a teacher row's pi_old - pi = 0.8, another's 0 (kept)
    x = dict(mask=mask, loss_mask=mask, logp=-torch.ones(6, 3), old_logp=old, sampler_logp=sampler, entropy=torch.zeros(6, 3),
             adv=torch.tensor([[-1.0], [-1], [1], [-1], [-1], [-1]]))
    logp = x["logp"].clone().requires_grad_()
    loss, diag, _ = grpo.token_objective(logp, x["entropy"], x, grpo.Args(num_iterations=2, opsm_delta=0.5))
    g, = torch.autograd.grad((loss * mask).sum(), logp)
    assert token_mean(diag, mask, "loss/opsm_frac") == 7 / 16  # rows 1, 3 and 4 dropped: 3 + 1 + 3 of 16 tokens
    e = math.exp(0.5)  # row 0: r = e^0.5 with A = -1, unclipped on that side: loss -r A = r, gradient -A r = r
    want = torch.tensor([[e] * 3, [0] * 3, [-1] * 3, [0] * 3, [0] * 3, [1] * 3]) * mask
    assert torch.allclose(loss * mask, want) and torch.allclose(g, want)
    loss, _, _ = grpo.token_objective(x["logp"], x["entropy"], x, grpo.Args(num_iterations=2))
    assert ((loss * mask).sum(-1) != 0).all()  # without OPSM no row's loss is 0


def test_opsm_against_trl():
    """TRL 1.16.0 GRPOTrainer.get_off_policy_mask + _compute_loss (loss_type "dapo", off_policy_mask_threshold
    0.1) on peer_inputs: rows 1 and 3 (A < 0, mean drift 0.272 and 0.407) lose their policy loss; with beta 0.04
    (TRL's KL: grpo's k3_ratio) the KL term is not masked."""
    x = peer_inputs()
    loss, g, _ = objective(x, opsm_delta=0.1)
    assert loss == pytest.approx(-0.6008347134352177, abs=1e-12)
    assert near(g, [[-0.0929549688, -0.0857574135, -0.0867570054, 0.0, -0.0698377047], [0.0] * 5,
                    [-0.0338010914, -0.0410659579, -0.0386466837, -0.0412446573, 0.0], [0.0] * 5])
    loss, g, _ = objective(x, opsm_delta=0.1, beta=0.04, kl="k3_ratio")
    assert loss == pytest.approx(-0.5979818627351418, abs=1e-12)
    assert near(g, [[-0.0946740988, -0.0861514045, -0.0857629904, 0.0011835293, -0.0692193694],
                    [0.0001915545, -0.0020016149, -0.0003623819, 0.0, 0.0],
                    [-0.0329490713, -0.0400771107, -0.0403702006, -0.040327393, 0.0], [0.0002099131, 0, 0, 0, 0]])


def test_top_entropy_against_trl():
    """TRL 1.16.0 get_high_entropy_mask (the float32 quantile of the masked-in entropies) and _compute_loss on
    peer_inputs, one micro-batch holding the step: rho 0.4 (threshold 1.4091143608), rho 0.5 (the threshold
    1.3526774645 is two tied tokens' entropy: both kept), rho 0 (the max only). The KL term is not masked."""
    x = peer_inputs()
    def kept(rho):  # one group of 4 (every A_i != 0), the entropies as pi_old's
        a = grpo.Args(num_generations=4, top_entropy_quantile=rho)
        adv, *_ = step(a, [1.0, 0.0, 1.0, 0.0], x["mask"], old_entropy=x["entropy"])
        return ((adv != 0) & (x["mask"] > 0)).int().tolist()
    assert kept(0.4) == [[0, 0, 1, 0, 0], [1, 0, 0, 0, 0], [0, 1, 0, 1, 0], [1, 0, 0, 0, 0]]
    assert kept(0.5) == [[0, 0, 1, 0, 1], [1, 0, 0, 0, 0], [1, 1, 0, 1, 0], [1, 0, 0, 0, 0]]
    assert kept(0.0) == [[0, 0, 0, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]]
    x["adv"] = x["adv"] * torch.tensor(kept(0.4), dtype=torch.float64)
    loss, g, _ = objective(x)  # TRL's "dapo": token-mean
    assert loss == pytest.approx(-0.026758648449860003, abs=1e-12)
    assert near(g, [[0, 0, -0.0867570054, 0, 0], [0.0500012799, 0, 0, 0, 0], [0, -0.0410659579, 0, -0.0412446573, 0],
                    [0] * 5])
    assert objective(x, "seq-mean-token-mean")[0] == pytest.approx(0.23089862482475298, abs=1e-12)  # TRL's "grpo"
    assert objective(x, beta=0.04, kl="k3_ratio")[0] == pytest.approx(-0.023905797749784005, abs=1e-12)


def test_entropy_bonus_by_hand():
    """loss -= c H per token, aggregated as the policy loss (verl's entropy_coeff): at A = 0 the entropy alone has
    a gradient, -c / n_tokens a token under token-mean, -c / (n_seq |o_i|) under seq-mean-token-mean."""
    mask = torch.tensor([[1.0, 1, 0], [1, 0, 0]])
    H = torch.tensor([[1.0, 2.0, 7.0], [4.0, 7.0, 7.0]], requires_grad=True)
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    b = dict(adv=torch.zeros(2, 1), loss_mask=mask, keep=mask > 0, sampler_logp=torch.full((2, 3), math.nan))
    loss, _, _ = grpo.token_objective(logp, H, b, grpo.Args(entropy_coef=0.1))
    for agg, value, g in (("token-mean", -0.1 * (1 + 2 + 4) / 3, [[-0.1 / 3] * 2 + [0], [-0.1 / 3, 0, 0]]),
                          ("seq-mean-token-mean", -0.1 * ((1 + 2) / 2 + 4) / 2, [[-0.025, -0.025, 0], [-0.05, 0, 0]])):
        total = grpo.aggregate_loss(loss, mask, agg, 3)[0]
        g_logp, g_H = torch.autograd.grad(total, [logp, H], retain_graph=True)
        assert total.item() == pytest.approx(value) and torch.allclose(g_H, torch.tensor(g))
        assert not g_logp.any()


@pytest.mark.parametrize("agg, value", [("token-mean", -0.3646998887563943),
                                        ("seq-mean-token-mean", 0.039387115992149356),
                                        ("seq-mean-token-sum", -1.1852746384582817),
                                        ("seq-mean-token-sum-norm", -0.23705492769165634)])
def test_entropy_bonus_against_verl(agg, value):
    """verl 0.9.1 compute_policy_loss_vanilla (dual-clip c = 3) - 0.01 agg_loss(entropy, mask, agg), as
    losses.ppo_loss composes them, on peer_inputs. TRL's "dapo" gives the token-mean value too; TRL's "grpo"
    (0.04112306503084442) takes a token mean of H whatever the loss type, where grpo.py follows --loss-agg."""
    x = peer_inputs()
    loss, _, g_H = objective(x, agg, entropy_coef=0.01, dual_clip=3.0)
    assert loss == pytest.approx(value, abs=1e-12)
    lengths, n_seq = x["mask"].sum(-1, keepdim=True), 4
    per_token = {"token-mean": 1 / lengths.sum(), "seq-mean-token-mean": 1 / (n_seq * lengths),
                 "seq-mean-token-sum": 1 / n_seq, "seq-mean-token-sum-norm": 1 / (n_seq * 5)}[agg]
    assert torch.allclose(g_H, -0.01 * per_token * x["mask"], rtol=0, atol=1e-15)



# tool tokens (--tools) inside completions of 5, 3, 4 and 1 tokens: 0 where a tool's result (and the template's
# words around it) stands, as collate makes the mask from each row's tool_mask
TOOL_MASK = [[1, 1, 0, 0, 1], [1, 0, 1, 1, 1], [1, 0, 0, 1, 1], [1, 1, 1, 1, 1]]


def tool_rows():
    """peer_inputs' completion lengths (5, 3, 4, 1): one group's rows, each row's tool mask cut from TOOL_MASK."""
    comps = [torch.arange(4, 4 + n) for n in (5, 3, 4, 1)]
    return [dict(prompt_ids=torch.tensor([1, 2]), completion=c, truncated=False, order=0, rewards={},
                 is_teacher=False, reward=0.0, logp=torch.zeros(len(c)), record={"prompt": "", "answer": ""},
                 tool_mask=torch.tensor(TOOL_MASK[i][:len(c)], dtype=torch.float)) for i, c in enumerate(comps)]


@pytest.mark.parametrize("kw", [dict(surrogate="clip", beta=0.04, kl="k3", entropy_coef=0.01),
                                dict(surrogate="cispo", beta=0.04, kl="k3_ratio"),
                                dict(surrogate="sapo", beta=0.04, kl="k2", entropy_coef=0.01),
                                dict(surrogate="gmpo", entropy_coef=0.01), dict(surrogate="vespo", beta=0.04),
                                dict(surrogate="clip_cov", cov_ratio=0.5), dict(surrogate="kl_cov", cov_ratio=0.5),
                                dict(ratio="sequence", dual_clip=3.0), dict(tis=2.0, tis_mode="sequence_mask"),
                                dict(opsm_delta=0.1, tis=2.0)], ids=lambda kw: "-".join(map(str, kw.values())))
@pytest.mark.parametrize("agg", grpo.LOSS_AGGS)
def test_tool_tokens_get_no_gradient_and_leave_the_loss_as_it_is(kw, agg):
    """collate's mask is 0 on tool tokens (each row's tool_mask), and through it no term reaches them: for every
    surrogate, KL estimator, the entropy bonus, IS weights and aggregation, the gradient there (log-probs and
    entropy) is exactly 0, and other values there (pi, pi_old, pi_ref, the sampler's, H: +3) change no loss."""
    b = grpo.collate(tool_rows(), 0, "cpu")
    x = peer_inputs()
    tool = (x["mask"] == 1) & (torch.tensor(TOOL_MASK) == 0)  # inside a completion, a tool's
    assert torch.equal(b["mask"].double(), x["mask"] * torch.tensor(TOOL_MASK)) and tool.sum() == 5
    x["mask"] = x["loss_mask"] = b["mask"].double()
    torch.manual_seed(0)  # (clip_cov draws its tokens)
    loss, g, g_H = objective(x, agg, **kw)
    assert not g[tool].any() and not g_H[tool].any() and g.abs().sum() > 0
    for k in ("logp", "old_logp", "sampler_logp", "ref_logp", "entropy"):
        x[k] = torch.where(tool, x[k] + 3.0, x[k])
    torch.manual_seed(0)
    assert objective(x, agg, **kw)[0] == loss


@pytest.mark.parametrize("kw, value, grad", [
    (dict(agg="seq-mean-token-mean", beta=0.04, kl="k3"), 0.07983751868966835,  # TRL's "grpo", beta 0.04
     [[-0.1031733468, -0.0933964565, 0, 0, -0.0748799567], [0.0815763019, 0, 0.0879270079, 0, 0],
      [-0.0535754041, 0, 0, -0.0658090716, 0], [0.000896602, 0, 0, 0, 0]]),
    (dict(agg="token-mean", entropy_coef=0.01), -0.21891518033418575,  # TRL's "dapo", entropy_coef 0.01
     [[-0.1510518243, -0.1393557969, 0, 0, -0.1134862701], [0.0812520798, 0, 0.0885441511, 0, 0],
      [-0.0549267735, 0, 0, -0.0670225681, 0], [0] * 5]),
    (dict(agg="seq-mean-token-sum-norm", beta=0.04, kl="k3_ratio"), -0.08179610525099512,  # "dr_grpo", bias-
     [[-0.0615381643, -0.0559984129, 0, 0, -0.0449925901], [0.0326253423, 0, 0.0351821122, 0, 0],  # corrected KL
      [-0.0214168964, 0, 0, -0.0262128055, 0], [0.0001364435, 0, 0, 0, 0]]),
    (dict(agg="token-mean", beta=0.04, kl="k3_ratio"), -0.2044902631274878,  # "bnpo", bias-corrected KL
     [[-0.1538454106, -0.1399960324, 0, 0, -0.1124814753], [0.0815633559, 0, 0.0879552804, 0, 0],
      [-0.0535422409, 0, 0, -0.0655320136, 0], [0.0003411088, 0, 0, 0, 0]])])
def test_tool_masked_loss_and_gradient_against_trl(kw, value, grad):
    """TRL 1.16.0 GRPOTrainer._compute_loss on peer_inputs with tool_mask = TOOL_MASK (its loss mask: completion_mask
    x tool_mask; num_items_in_batch counts it too), its own code run on them: the loss and d loss / d log pi."""
    x = peer_inputs()
    x["mask"] = x["loss_mask"] = grpo.collate(tool_rows(), 0, "cpu")["mask"].double()
    loss, g, _ = objective(x, **kw)
    assert loss == pytest.approx(value, abs=1e-12) and near(g, grad)

def cov_inputs(log_r00=0.3):
    """2 rows of 2 tokens and a pad: A = 2, -1 (token mean 0.5), logp -1 -2 / -0.5 -3 (mean -1.625), so
    cov = (A - 0.5)(logp + 1.625) = 0.9375, -0.5625 / -1.6875, 2.0625; the pad (logp 5) would top them all.
    r = e^(log r): e^0.3 = 1.35 clips where A > 0 (eps 0.2), e^-0.2 = 0.82 and e^0.05 do not."""
    logp = torch.tensor([[-1.0, -2.0, 5.0], [-0.5, -3.0, 5.0]])
    log_r = torch.tensor([[log_r00, -0.2, 0.0], [0.3, 0.05, 0.0]])
    x = dict(logp=logp, old_logp=logp - log_r, adv=torch.tensor([[2.0], [-1.0]]),
                mask=torch.tensor([[1.0, 1, 0], [1, 1, 0]]), sampler_logp=logp - log_r, entropy=torch.zeros(2, 3))
    x["loss_mask"] = x["mask"]
    return x


def token_loss(x, **kw):  # token_objective's loss and d(sum)/dlogp on the trained tokens (num_iterations 2)
    logp = x["logp"].clone().requires_grad_()
    loss, _, _ = grpo.token_objective(logp, x["entropy"], x, grpo.Args(num_iterations=2, **kw))
    loss = torch.where(x["mask"] > 0, loss, 0)
    return loss.detach(), torch.autograd.grad(loss.sum(), logp)[0]


def test_kl_cov_by_hand():
    """KL-Cov (2505.22617), as verl: -r A everywhere (no clip), + cov_kl_coef |log r| at the top cov_ratio of the
    tokens by cov; a tiny batch still selects one token (max(1, int(2e-4 * 4))): [1, 1], cov 2.0625."""
    e = math.exp
    loss, g = token_loss(cov_inputs(), surrogate="kl_cov")
    assert torch.allclose(loss, torch.tensor([[-2 * e(0.3), -2 * e(-0.2), 0], [e(0.3), e(0.05) + 0.1 * 0.05, 0]]))
    assert torch.allclose(g, torch.tensor([[-2 * e(0.3), -2 * e(-0.2), 0], [e(0.3), e(0.05) + 0.1, 0]]))
    loss, g = token_loss(cov_inputs(), surrogate="kl_cov", cov_ratio=0.5, cov_kl_coef=1.0)  # 2 tokens: + [0, 0]
    assert torch.allclose(g, torch.tensor([[-2 * e(0.3) + 1, -2 * e(-0.2), 0], [e(0.3), e(0.05) + 1, 0]]))


def test_clip_cov_by_hand():
    """Clip-Cov (2505.22617), as verl: the clip loss, and none (no gradient) at cov_ratio of the tokens, drawn by
    torch.randperm among the unclipped ones with cov_low < cov < cov_high (strictly); at least one."""
    e = math.exp
    want = [[-2 * 1.2, -2 * e(-0.2), 0], [e(0.3), 0, 0]], [[0, -2 * e(-0.2), 0], [e(0.3), 0, 0]]
    for ratio in (2e-4, 1.0):  # [0, 0] (cov 0.9375) is clipped: [1, 1] alone is drawn, of 1 token or all
        loss, g = token_loss(cov_inputs(), surrogate="clip_cov", cov_low=0.5, cov_ratio=ratio)
        assert torch.allclose(loss, torch.tensor(want[0])) and torch.allclose(g, torch.tensor(want[1]))
    x = cov_inputs(log_r00=0.1)  # [0, 0] unclipped: two candidates, [0, 0] and [1, 1]
    for seed in range(6):  # the one drawn is randperm's first, under the seed: both happen
        torch.manual_seed(seed)
        first = torch.randperm(2)[0].item()
        torch.manual_seed(seed)
        _, g = token_loss(x, surrogate="clip_cov", cov_low=0.5)
        assert [g[0, 0].item() == 0, g[1, 1].item() == 0] == [first == 0, first == 1]
    _, g = token_loss(x, surrogate="clip_cov", cov_low=0.5, cov_ratio=1.0)  # every candidate
    assert g[0, 0] == g[1, 1] == 0 and g[0, 1] != 0
    _, g = token_loss(x, surrogate="clip_cov", cov_low=0.9375, cov_ratio=1.0)  # cov = 0.9375: not above cov_low
    assert g[0, 0] != 0 and g[1, 1] == 0
    _, g = token_loss(x, surrogate="clip_cov", cov_low=0.5, cov_high=2.0625, cov_ratio=1.0)  # nor below cov_high
    assert g[0, 0] == 0 and g[1, 1] != 0


@pytest.mark.parametrize("kw, seed, value, grad, drawn", [
    (dict(cov_ratio=1.0), None, -0.672332155552938, None, 1),  # every candidate (one: [1, 0], cov 1.0078)
    (dict(), 0, -0.672332155552938, None, 1),  # the defaults: max(1, int(2e-4 * 13)) = 1 token, the same one
    (dict(cov_ratio=1.0, cov_low=0.1), None, -0.3683118631915567, None, 4),  # 4 candidates, all
    (dict(cov_ratio=0.1, cov_low=0.1), 0, -0.42059154669750953,  # 1 of the 4, torch.manual_seed(0): [0, 2]
     [[-0.154924948, -0.1429290225, 0, 0, -0.1163961744], [0.1071455998, 0.1100374919, 0.1167615179, 0, 0],
      [-0.0676021828, -0.0821319159, -0.0772933674, -0.0824893145, 0], [0] * 5], 1),
])
def test_clip_cov_against_verl(kw, seed, value, grad, drawn):
    """verl 0.9.1 compute_policy_loss_clip_cov (clip_ratio 0.2, token-mean; torch.manual_seed(0) right before
    the call where it draws) on peer_inputs with A = 2, -1.5, 1, -2.5."""
    x = peer_inputs()
    x["adv"] = torch.tensor([[2.0], [-1.5], [1.0], [-2.5]], dtype=torch.float64)
    if seed is not None:
        torch.manual_seed(seed)
    loss, g, _ = objective(x, surrogate="clip_cov", **kw)
    assert loss == pytest.approx(value, abs=1e-12)
    assert grad is None or near(g, grad)
    if seed is not None:
        torch.manual_seed(seed)
    _, diag, _ = grpo.token_objective(x["logp"], x["entropy"], x, grpo.Args(num_iterations=2, surrogate="clip_cov",
                                                                             **kw))
    assert token_mean(diag, x["mask"], "loss/cov_frac") == drawn / 13  # verl's pg_clipfrac: the tokens held back


@pytest.mark.parametrize("kw, value, grad", [
    (dict(), -0.5999282803944296,  # the defaults: 1 token ([1, 0], cov 1.0078), coefficient 0.1
     [[-0.154924948, -0.1429290225, -0.1445950091, -0.2057438035, -0.1163961744],
      [0.0994532921, 0.1100374919, 0.1167615179, 0, 0], [-0.0676021828, -0.0821319159, -0.0772933674, -0.0824893145, 0],
      [0.1396629837, 0, 0, 0, 0]]),
    (dict(cov_ratio=0.3, cov_kl_coef=1.0), -0.5849889566390186,  # int(0.3 * 13) = 3 tokens, coefficient 1
     [[-0.154924948, -0.1429290225, -0.221518086, -0.2057438035, -0.1163961744],
      [0.0302225229, 0.1100374919, 0.1167615179, 0, 0], [-0.0676021828, -0.005208839, -0.0772933674, -0.0824893145, 0],
      [0.1396629837, 0, 0, 0, 0]]),
])
def test_kl_cov_against_verl(kw, value, grad):
    """verl 0.9.1 compute_policy_loss_kl_cov (token-mean) on peer_inputs with A = 2, -1.5, 1, -2.5."""
    x = peer_inputs()
    x["adv"] = torch.tensor([[2.0], [-1.5], [1.0], [-2.5]], dtype=torch.float64)
    loss, g, _ = objective(x, surrogate="kl_cov", **kw)
    assert loss == pytest.approx(value, abs=1e-12) and near(g, grad)
    _, diag, _ = grpo.token_objective(x["logp"], x["entropy"], x, grpo.Args(num_iterations=2, surrogate="kl_cov", **kw))
    assert token_mean(diag, x["mask"], "loss/cov_frac") == int(max(1, kw.get("cov_ratio", 0) * 13)) / 13  # 1, or 3


def test_gmpo_by_hand():
    """GMPO (2507.20673): -A_i exp(mean_t log r_t), each log r_t clipped to [-eps_low, eps_high] on A_i's side
    only (min with A > 0, max with A < 0), a mean over o_i's tokens; seq-mean-token-mean. A clipped token has no
    gradient, the others -A_i s_i / |o_i| each (then / n_seq). Here eps_low 0.3, eps_high 0.4 (log space)."""
    mask = torch.tensor([[1.0, 1], [1, 1], [1, 0]])
    log_r = torch.tensor([[0.5, -0.1], [0.5, -0.5], [0.2, 5.0]])  # row 2's 5.0 is padding
    logp = torch.full((3, 2), -1.0, requires_grad=True)
    adv = torch.tensor([[1.0], [-1.0], [1.0]])
    a = grpo.Args(surrogate="gmpo", eps_low=0.3, eps_high=0.4)
    loss, _, _ = grpo.policy_loss(logp, logp.detach() - log_r, adv, mask, a)
    total = grpo.aggregate_loss(loss, mask, "seq-mean-token-mean", 2)[0]
    g, = torch.autograd.grad(total, logp)
    e = math.exp
    # row 0 (A > 0): 0.5 -> 0.4, -0.1 kept: s = e^0.15. Row 1 (A < 0): 0.5 kept, -0.5 -> -0.3: s = e^0.1.
    # Row 2: one token, s = e^0.2
    assert total.item() == pytest.approx((-e(0.15) + e(0.1) - e(0.2)) / 3)
    assert torch.allclose(g, torch.tensor([[0, -e(0.15) / 6], [e(0.1) / 6, 0], [-e(0.2) / 3, 0]]))


def test_gmpo_leaves_tokens_the_entropy_quantile_drops_out_of_its_mean():
    """With a per-token advantage that is 0 on a token (--top-entropy-quantile dropped it), GMPO's geometric mean is
    over the kept tokens, and the row's loss is -A_i times it, whatever share of its tokens is kept (GMPO's objective
    is one term a sequence; TRL's GMPOTrainer with its entropy mask): A = 1, log r = [0.5, 0.1], token 1 dropped ->
    -e^clip(0.5) = -e^0.4 for the row (not half of it), with no gradient (token 0 is clipped)."""
    logp = torch.full((1, 2), -1.0, requires_grad=True)
    a = grpo.Args(surrogate="gmpo", eps_low=0.4, eps_high=0.4)
    loss, _, _ = grpo.policy_loss(logp, logp.detach() - torch.tensor([[0.5, 0.1]]), torch.tensor([[1.0, 0.0]]),
                                  torch.ones(1, 2), a)
    total = grpo.aggregate_loss(loss, torch.ones(1, 2), "seq-mean-token-mean", 2)[0]
    assert loss.shape == (1, 1) and total.item() == pytest.approx(-math.exp(0.4))
    assert not torch.autograd.grad(total, logp)[0].any()


def quantile_kept(x, rho):  # the step's top-rho tokens of peer_inputs by entropy (one group of 4, every A_i != 0)
    return step(grpo.Args(num_generations=4, top_entropy_quantile=rho), [1.0, 0.0, 1.0, 0.0], x["mask"],
                old_entropy=x["entropy"])[3]


@pytest.mark.parametrize("rho, eps, value, grad", [
    (0.4, 0.4, 0.019132275653694242, [[0, 0, -0.2819602677, 0, 0], [0.1625041597, 0, 0, 0, 0],
                                      [0, -0.0668772172, 0, -0.0668772172, 0], [0.2723428182, 0, 0, 0, 0]]),
    (0.5, 0.2, 0.0912920876353647, [[0, 0, -0.1264883771, 0, -0.1264883771], [0.1625041597, 0, 0, 0, 0],
                                    [-0.0417531167, -0.0417531167, 0, -0.0417531167, 0], [0] * 5]),
])
def test_gmpo_with_the_entropy_quantile_against_trl(rho, eps, value, grad):
    """TRL 1.16.0 GMPOTrainer._compute_loss (top_entropy_quantile rho, epsilon eps; one micro-batch holding the step)
    on peer_inputs: the geometric mean over the kept tokens, each row -A_i times it, a mean over rows: --loss-agg
    seq-mean-token-mean. (Each row scaled by kept / |o_i|, as grpo.py had it, the first gave 0.2032.)"""
    x = peer_inputs()
    x["adv"] = x["adv"] * quantile_kept(x, rho)
    loss, g, _ = objective(x, "seq-mean-token-mean", surrogate="gmpo", eps_low=eps, eps_high=eps)
    assert loss == pytest.approx(value, abs=1e-12) and near(g, grad)


def test_the_entropy_bonus_acts_on_the_tokens_the_entropy_quantile_keeps_against_trl():
    """TRL 1.16.0 GRPOTrainer._compute_loss (loss_type "dapo", entropy_coef 0.01, top_entropy_quantile 0.4) on
    peer_inputs: the bonus acts on the 5 kept tokens only (the 80/20 paper trains those alone). TRL takes the mean H
    over them (its gradient -0.01 / 5 a kept token); grpo.py aggregates the bonus as the loss (-0.01 / 13 under
    token-mean), so the value differs by that normaliser; the policy loss's gradient is TRL's."""
    x = peer_inputs()
    keep = quantile_kept(x, 0.4)
    x.update(adv=x["adv"] * keep, keep=keep)
    loss, g_logp, g_H = objective(x, entropy_coef=0.01)
    assert keep.sum() == 5 and torch.equal(g_H != 0, keep)
    trl_g_H = -0.002 * keep.double()  # TRL's, on these 5 tokens
    assert torch.allclose(g_H, trl_g_H * 5 / 13, rtol=0, atol=1e-15)
    assert near(g_logp, [[0, 0, -0.0867570054, 0, 0], [0.0500012799, 0, 0, 0, 0],
                         [0, -0.0410659579, 0, -0.0412446573, 0], [0] * 5])
    H_kept = x["entropy"][keep].sum().item()
    assert loss == pytest.approx(-0.048049690300903704 + 0.01 * H_kept / 5 - 0.01 * H_kept / 13, abs=1e-12)


def test_gmpo_against_verl_and_trl():
    """verl 0.9.1 compute_policy_loss_geo_mean (clip_ratio 0.4 and 0.2, log space) and TRL 1.16.0 GMPOTrainer
    (epsilon 0.4: 0.02264921473915993, the same to 1e-16) on peer_inputs, with --loss-agg seq-mean-token-mean:
    the peers' mean over rows (no row of peer_inputs is empty)."""
    x = peer_inputs()
    loss, g, _ = objective(x, "seq-mean-token-mean", surrogate="gmpo", eps_low=0.4, eps_high=0.4)
    assert loss == pytest.approx(0.0226492147391599, abs=1e-12)
    assert near(g, [[-0.0586133735] * 5, [0.0562393733] * 3 + [0, 0], [-0.0313362139] * 4 + [0],
                    [0.2723428182, 0, 0, 0, 0]])
    loss, g, _ = objective(x, "seq-mean-token-mean", surrogate="gmpo", eps_low=0.2, eps_high=0.2)
    assert loss == pytest.approx(0.06259750333548483, abs=1e-12)
    assert near(g, [[-0.0575599587] * 3 + [0, -0.0575599587], [0.0562393733] * 3 + [0, 0],
                    [-0.0313362139] * 4 + [0], [0] * 5])


def test_vespo_by_hand_and_against_trl():
    """VESPO (2602.10693), TRL's form: -sg(phi) A log pi, phi = w^k e^(lam (1 - w)), w = prod_t r_t over o_i's
    tokens; (k, lam) = (2, 3) where A >= 0, (3, 2) where A < 0. Then TRL 1.16.0 _compute_loss(loss_type "vespo")
    on peer_inputs (phi = 1.1020621782, 0.8857953733, 0.9888594989, 0.6622658569), and on-policy (phi = 1)."""
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1]])
    log_r = torch.tensor([[0.2, -0.1, 5.0], [0.1, 0.2, 0.0]])  # w = e^0.1 (the 5.0 is padding), e^0.3
    logp = torch.tensor([[-1.0, -2, -3], [-0.5, -1.5, -2.5]], requires_grad=True)
    loss, _, _ = grpo.policy_loss(logp, logp.detach() - log_r, torch.tensor([[1.0], [-1.0]]), mask,
                                  grpo.Args(surrogate="vespo"))
    g, = torch.autograd.grad((loss * mask).sum(), logp)
    e = math.exp
    phi = [e(0.1) ** 2 * e(3 * (1 - e(0.1))), e(0.3) ** 3 * e(2 * (1 - e(0.3)))]  # 0.8909, 1.2217
    assert torch.allclose(loss * mask, torch.tensor([[phi[0], 2 * phi[0], 0], [-0.5 * phi[1], -1.5 * phi[1],
                                                                                -2.5 * phi[1]]]))
    assert torch.allclose(g, torch.tensor([[-phi[0], -phi[0], 0], [phi[1]] * 3]))  # no gradient through phi
    x = peer_inputs()
    loss, g, _ = objective(x, surrogate="vespo")
    assert loss == pytest.approx(0.7043296678688784, abs=1e-12)
    assert near(g, [[-0.1017288165] * 5, [0.0476966739] * 3 + [0, 0], [-0.0380330577] * 4 + [0],
                    [0.0764152912, 0, 0, 0, 0]])
    x["old_logp"] = x["logp"]
    assert objective(x, surrogate="vespo")[0] == pytest.approx(0.5801922110410836, abs=1e-12)


def test_luspo_is_gspo_with_each_sequence_scaled_by_its_length():
    """LUSPO (2602.05261), TRL 1.16.0 loss_type "luspo": mean_i |o_i| l_i, l_i GSPO's loss of row i,
    -min(s_i A_i, clip(s_i, 1 - eps, 1 + eps) A_i), s_i = exp(mean_t log r_t): --ratio sequence --loss-agg
    seq-mean-token-sum, value and gradient, written out here on peer_inputs; TRL's value -1.1605594012973246."""
    x = peer_inputs()
    loss, g, _ = objective(x, "seq-mean-token-sum", ratio="sequence")
    logp = x["logp"].clone().requires_grad_()
    rows = []
    for i in range(4):
        n = int(x["mask"][i].sum())
        s = torch.exp((logp[i, :n] - x["old_logp"][i, :n]).mean())
        A = x["adv"][i, 0]
        rows.append(n * -torch.min(s * A, s.clamp(0.8, 1.2) * A))
    want = sum(rows) / 4
    assert loss == pytest.approx(want.item(), abs=1e-12) and loss == pytest.approx(-1.1605594012973246, abs=1e-12)
    assert torch.allclose(g, torch.autograd.grad(want, logp)[0], rtol=0, atol=1e-14)
    assert near(g, [[-0.2930668677] * 5, [0.1687181198] * 3 + [0, 0], [-0.1253448556] * 4 + [0], [0] * 5])


def tis_inputs():
    """On-policy (pi_old = pi, logp 0), A = 1: the clip loss is -w a token, w = pi_old / pi_sampler. Rows: w per
    token 1 2 4; 0.5 0.25 1; 2 1 1 (product 2: the cap); a teacher row (no sampler: NaN); 0.5 and padding
    (product 0.5: the floor). The pad's w = e^50 counts nowhere."""
    nan, l2 = math.nan, math.log(2)
    log_w = torch.tensor([[0, l2, 2 * l2], [-l2, -2 * l2, 0], [l2, 0, 0], [nan] * 3, [-l2, 50, 50]],
                         dtype=torch.float64)
    mask = torch.tensor([[1.0, 1, 1]] * 4 + [[1, 0, 0]], dtype=torch.float64)
    return dict(adv=torch.ones(5, 1, dtype=torch.float64), mask=mask, loss_mask=mask, sampler_logp=-log_w)


@pytest.mark.parametrize("mode, w", [
    ("token_truncate", [[1, 2, 2], [0.5, 0.5, 1], [2, 1, 1], [1, 1, 1], [0.5, 0, 0]]),
    ("token_mask", [[1, 2, 0], [0.5, 0, 1], [2, 1, 1], [1, 1, 1], [0.5, 0, 0]]),  # the bounds kept
    ("sequence_truncate", [[2] * 3, [0.5] * 3, [2] * 3, [1] * 3, [0.5, 0, 0]]),  # products 8 and 1/8 clamped
    ("sequence_mask", [[0] * 3, [0] * 3, [2] * 3, [1] * 3, [0.5, 0, 0]]),  # 2 and 0.5: at the bounds, kept
])
def test_tis_modes_at_their_bounds_by_hand(mode, w):
    """--tis 2 --tis-min 0.5: w per token or its product over o_i, clamped to [0.5, 2] or 0 outside it (IcePop);
    a teacher row weighs 1, also under a floor above 1 (--tis 4 --tis-min 1.5), where a student's w = 1 would
    not. The gradient is the weight times the clip loss's (-A)."""
    x = tis_inputs()
    logp = torch.zeros(5, 3, dtype=torch.float64, requires_grad=True)
    loss, diag, _ = grpo.token_objective(logp, torch.zeros(5, 3), x, grpo.Args(tis=2.0, tis_mode=mode, tis_min=0.5))
    g, = torch.autograd.grad((loss * x["mask"]).sum(), logp)
    assert (-loss * x["mask"]).tolist() == w and (-g).tolist() == w
    # loss/tis_frac: the tokens whose w left [0.5, 2], masked or clamped: 4 and 0.25 per token, rows 0 and 1's
    # products 8 and 1/8 (3 tokens each) a sequence; of 13 (the teacher row counts, its w never changes)
    assert token_mean(diag, x["mask"], "loss/tis_frac") == (2 if mode.startswith("token") else 6) / 13
    loss, diag, _ = grpo.token_objective(logp, torch.zeros(5, 3), x, grpo.Args(tis=4.0, tis_mode=mode, tis_min=1.5))
    assert (-loss[3]).tolist() == [1, 1, 1]  # the teacher row, never counted in loss/tis_frac:
    assert token_mean(diag, x["mask"], "loss/tis_frac") == 7 / 13  # 1 + 3 + 2 + 1 per token; 3 + 3 + 1 a sequence
    assert -loss[2, 1].item() == {"token_truncate": 1.5, "token_mask": 0}.get(mode, 2)  # w = 1 floored or dropped
    if mode == "token_mask":  # no floor: only the cap
        loss, _, _ = grpo.token_objective(logp, torch.zeros(5, 3), x, grpo.Args(tis=2.0, tis_mode=mode))
        assert (-loss[1]).tolist() == [0.5, 0.25, 1]


TRL_IS_RATIO = {  # TRL 1.16.0's inline vLLM IS block on peer_inputs, clip_max 3, clip_min None (token_truncate)
    "token": [[0.8221669943, 0.6720911697, 3.0, 0.6794041591, 0.7805605599],
              [0.7859986986, 0.809883027, 0.7746487001, 1, 1],
              [1.3329391849, 0.3536623243, 1.1757614237, 1.2294941342, 1], [0.9167987716, 1, 1, 1, 1]],
    "sequence": [[1.0832729736582332], [0.4931158031277184], [0.6814669534249829], [0.9167987716426717]]}
TRL_IS_CHANGES = {("token_mask", 0.0): {(0, 2): 0}, ("token_truncate", 0.5): {(2, 1): 0.5},  # and clip_min 0.5
                  ("token_mask", 0.5): {(0, 2): 0, (2, 1): 0}, ("sequence_truncate", 0.5): {(1,): 0.5},
                  ("sequence_mask", 0.5): {(1,): 0}}


@pytest.mark.parametrize("mode, floor", itertools.product(["token_truncate", "token_mask", "sequence_truncate",
                                                            "sequence_mask"], [0.0, 0.5]))
def test_tis_weights_against_trl(mode, floor):
    """The weight, read off the loss at r = 1 and A = -1 (where the clip loss is w): TRL's w = pi_old /
    pi_sampler on peer_inputs, --tis 3 and --tis-min 0 or 0.5: at [0, 2] it is e^1.307 = 3.70, over the cap
    (3, or 0 masked), at [2, 1] 0.354, under the floor (0.5, or 0); row 1's product 0.493 too."""
    x = peer_inputs()
    x["adv"] = -torch.ones(4, 1, dtype=torch.float64)
    loss, _, _ = grpo.token_objective(x["old_logp"], x["entropy"], x, grpo.Args(tis=3.0, tis_mode=mode, tis_min=floor))
    want = torch.tensor(TRL_IS_RATIO[mode.split("_")[0]], dtype=torch.float64).expand(4, 5).clone()
    for at, w in TRL_IS_CHANGES.get((mode, floor), {}).items():
        want[at] = w
    assert near(loss * x["mask"], (want * x["mask"]).tolist())


def test_tis_against_trl():
    """TRL 1.16.0 _compute_loss with the vLLM IS ratio (loss_type "dapo") on peer_inputs: token_truncate with
    beta 0.04 (the KL term is not weighted), and sequence_mask; clip_max 3."""
    x = peer_inputs()
    loss, g, _ = objective(x, tis=3.0, beta=0.04, kl="k3_ratio")
    assert loss == pytest.approx(-0.46925044035409014, abs=1e-12)
    assert near(g, [[-0.0781436374, -0.0580307914, -0.2592770013, 0.0011835293, -0.0538942226],
                    [0.0394924954, 0.0395865504, 0.0418472252, 0, 0],
                    [-0.0442027791, -0.0135346349, -0.0471627968, -0.0497927999, 0], [0.0002099131, 0, 0, 0, 0]])
    assert objective(x, tis=3.0, tis_mode="sequence_mask")[0] == pytest.approx(-0.42721000485725685, abs=1e-12)


# ----------------------------------------------------------------------------- the advantage estimators
def test_scale_batch_by_hand_and_against_trl():
    """Lite PPO (2508.08221): (R_i - mean_g) / (std(R) + eps), the std (unbiased) over every reward of the step;
    TRL 1.16.0 scale_rewards="batch" (eps 1e-4) on these rewards."""
    R = [1.0, 0, 0, 1, 1, 1, 1, 1, 0, 0.5, 0, 0]
    adv, _ = grpo.group_advantages(torch.tensor(R, dtype=torch.float64).view(3, 4), "batch", 1e-4)
    sd = statistics.stdev(R)
    means = [statistics.mean(R[i:i + 4]) for i in (0, 4, 8)]
    assert adv.flatten().tolist() == pytest.approx([(r - means[i // 4]) / (sd + 1e-4) for i, r in enumerate(R)])
    trl = [1.0036081075668335, -1.0036081075668335, -1.0036081075668335, 1.0036081075668335, 0, 0, 0, 0,
           -0.2509020268917084, 0.7527060508728027, -0.2509020268917084, -0.2509020268917084]  # (float32)
    assert adv.flatten().tolist() == pytest.approx(trl, abs=1e-7)


VERL_SCORES = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 1.0, 0.0]  # verl 0.9.1's estimators: two groups of 4
VERL_LENGTHS = [6, 2, 4, 3, 5, 1, 6, 2]


def lengths_mask(lengths, T=6):
    return (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).double()


def test_rloo_by_hand_and_against_verl():
    """RLOO (2402.14740): A_i = R_i - the mean of the group's other G - 1 rewards; verl 0.9.1
    compute_rloo_outcome_advantage on VERL_SCORES. Equal rewards: A = 0, so the skip stays."""
    a = grpo.Args(num_generations=4, adv_estimator="rloo")
    _, row_adv, _, _, flat, *_ = step(a, VERL_SCORES)
    s = VERL_SCORES
    loo = [s[i] - statistics.mean(s[j] for j in range(4 * (i // 4), 4 * (i // 4) + 4) if j != i) for i in range(8)]
    assert row_adv.tolist() == pytest.approx(loo)
    verl = [0.6666666865348816, -0.6666666865348816, -0.6666666865348816, 0.6666666865348816, 0.0, 0.0,
            0.6666666865348816, -0.6666666865348816]
    assert row_adv.tolist() == pytest.approx(verl, abs=1e-7) and not flat.any()
    _, row_adv, _, _, flat, *_ = step(a, [1.0, 1, 1, 1, 1, 0, 0, 0])
    assert flat.tolist() == [True] * 4 + [False] * 4 and not row_adv[:4].any()


def test_reinforce_plus_plus_baseline_by_hand_and_against_verl():
    """REINFORCE++-baseline (2501.03262), as verl 0.9.1: a_i = R_i - mean_g, then whitened over the step's TOKENS
    (a completion counts |o_i| times; unbiased over the token count; 1e-8 in the rsqrt). An equal-reward group
    gets A != 0: it is not flagged flat, so it is trained."""
    a = grpo.Args(num_generations=4, adv_estimator="reinforce_plus_plus_baseline")
    _, row_adv, _, _, flat, *_ = step(a, VERL_SCORES, lengths_mask(VERL_LENGTHS))
    centred = [r - statistics.mean(VERL_SCORES[4 * (i // 4):4 * (i // 4) + 4]) for i, r in enumerate(VERL_SCORES)]
    tokens = [c for c, n in zip(centred, VERL_LENGTHS) for _ in range(n)]
    mu, var = statistics.mean(tokens), statistics.variance(tokens)
    assert row_adv.tolist() == pytest.approx([(c - mu) / math.sqrt(var + 1e-8) for c in centred])
    verl = [0.8695778250694275, -1.422945499420166, -1.422945499420166, 0.8695778250694275, -0.27668383717536926,
            -0.27668383717536926, 0.8695778250694275, -1.422945499420166]
    assert row_adv.tolist() == pytest.approx(verl, abs=1e-6)
    _, row_adv, _, _, flat, *_ = step(a, [1.0, 1, 1, 1, 1, 0, 0, 0], lengths_mask(VERL_LENGTHS))
    assert not flat.any() and (row_adv[:4] < 0).all()  # equal rewards, shifted by the token-weighted mean


def test_gdpo_by_hand_and_against_trl():
    """GDPO (2601.05242), TRL 1.16.0 multi_objective_aggregation="normalize_then_sum" (eps 1e-4): each reward
    normalised in its group, weighted by --rewards, summed, then whitened over the step's completions. Equal
    totals need not mean equal parts: such a group is not flat (flat: its A is 0, as where its parts are equal)."""
    r1 = [1.0, 0, 0, 1, 1, 1, 1, 1, 0, 0.5, 0, 0]
    r2 = torch.tensor([1.0, 1, 0, 0, 0, 1, 1, 0, 0.2, 0.4, 0.6, 0.8]).double().tolist()  # (float32 values)
    a = grpo.Args(num_generations=4, adv_estimator="gdpo", rewards="correct,format:0.5", std_eps=1e-4)
    per_fn = torch.tensor([r1, r2], dtype=torch.float64).T
    _, row_adv, _, _, flat, *_ = step(a, (per_fn * torch.tensor([1, 0.5])).sum(1), per_fn=per_fn)
    def z(r, i):  # r_i normalised in its group
        g = r[4 * (i // 4):4 * (i // 4) + 4]
        return (r[i] - statistics.mean(g)) / (statistics.stdev(g) + 1e-4)
    S = [z(r1, i) + 0.5 * z(r2, i) for i in range(12)]
    assert row_adv.tolist() == pytest.approx([(s - statistics.mean(S)) / (statistics.stdev(S) + 1e-4) for s in S])
    trl = [1.575749158859253, -0.525249719619751, -1.575749158859253, 0.525249719619751, -0.525249719619751,
           0.525249719619751, 0.525249719619751, -0.525249719619751, -1.3109142780303955, 1.5842576026916504,
           -0.37152013182640076, 0.09817692637443542]
    assert row_adv.tolist() == pytest.approx(trl, abs=1e-6) and not flat.any()
    _, same, *_ = step(replace(a, scale="none"), (per_fn * torch.tensor([1, 0.5])).sum(1), per_fn=per_fn)
    assert torch.equal(same, row_adv)  # each reward's z-score whatever --scale (TRL's, the paper's)
    per_fn = torch.tensor([[1.0, 0], [0, 2], [1, 1], [1, 1]])  # totals 1, 1 | 1.5, 1.5 (weights 1, 0.5)
    a = replace(a, num_generations=2)
    _, row_adv, _, _, flat, *_ = step(a, (per_fn * torch.tensor([1, 0.5])).sum(1), per_fn=per_fn)
    assert not flat[:2].any() and row_adv[0] != row_adv[1] and flat[2:].all()  # (parts equal too: A = 0)


def test_an_equal_reward_group_s_advantage_is_exactly_0():
    """A = 0 in a group whose rewards are equal, as the papers' formulas give: float32's mean of eight 2.9s is not
    2.9 to the last bit, and that rounding (2.4e-7) over std + 1e-6 was an A of 0.24 for each row, of one sign
    in the group, trained wherever equal groups are (a KL term, an entropy bonus, --no-skip-zero-variance).
    RLOO's leave-one-out mean too (float64's mean of three 0.7s is 1.1e-16 off)."""
    r = torch.tensor([[2.9] * 8, [1.2] * 8, [0.0, 1.0] * 4])
    for scale in ("std", "batch", "none"):
        adv = grpo.group_advantages(r, scale)[0]
        assert adv[:2].eq(0).all() and adv[2].abs().min() > 0.4, scale
    a = grpo.Args(num_generations=3, adv_estimator="rloo", scale="none")
    assert step(a, [0.7] * 3 + [0.0, 1, 0])[1].tolist() == [0, 0, 0, -0.5, 1, -0.5]


def test_flat_is_read_off_the_advantage_whatever_the_estimator(monkeypatch):
    """prepare skips the rows step_terms flags flat (where probe finds no gradient at A = 0), and flat is read off
    the advantage itself: a group whose A is 0 on every row, by whichever estimator made it. A forked estimator
    that gives an equal-reward group an A (here every A + 0.1) needs no flag of its own to have it trained."""
    a = grpo.Args(num_generations=2)
    assert step(a, [1.0, 1.0, 0.0, 1.0])[4].tolist() == [True, True, False, False]
    real = grpo.group_advantages
    monkeypatch.setattr(grpo, "group_advantages", lambda r, *args: (real(r, *args)[0] + 0.1, "A + 0.1"))
    assert not step(a, [1.0, 1.0, 0.0, 1.0])[4].any()


def test_gdpo_weighs_each_reward_as_build_rewards_reads_rewards():
    """--rewards is parsed once (parse_rewards): spaces and a weight left out mean what build_rewards takes them to
    mean (1), in the step's GDPO sum too (it was a ValueError inside the first update)."""
    per_fn = torch.tensor([[1.0, 0, 0, 1, 1, 0], [1, 1, 0, 0, 0.5, 0]]).T.double()
    a = grpo.Args(num_generations=3, adv_estimator="gdpo", rewards="correct,format:0.5")
    want = step(a, per_fn @ torch.tensor([1, 0.5]).double(), per_fn=per_fn)[1]
    spaced = replace(a, rewards=" correct: , format : 0.5 ")
    assert [(n, w) for n, _, w in grpo.build_rewards(spaced)] == [("correct", 1.0), ("format", 0.5)]
    assert torch.equal(step(spaced, per_fn @ torch.tensor([1, 0.5]).double(), per_fn=per_fn)[1], want)
    quarter = replace(a, rewards="correct,format:0.25")
    other = step(quarter, per_fn @ torch.tensor([1, 0.25]).double(), per_fn=per_fn)[1]
    assert not torch.allclose(other, want)  # the weight reaches the sum
    more = torch.cat([per_fn, torch.tensor([[0.0, 1, 1, 0, 1, 1], [0, -0.5, 0, 0, -1, 0]]).T.double()], 1)
    b = replace(a, reward_fn="r.py:mine", overlong_penalty=True)  # --reward-fn's and the penalty's: weight 1
    parts = [grpo.group_advantages(col.view(-1, 3), "std", a.std_eps)[0] for col in more.T]
    S = sum(w * p for w, p in zip([1, 0.5, 1, 1], parts)).reshape(-1)
    got = step(b, more @ torch.tensor([1, 0.5, 1, 1]).double(), per_fn=more)[1]
    assert torch.allclose(got, (S - S.mean()) / (S.std() + a.std_eps))  # (zip once dropped the fourth)


def test_adaptive_kl_in_reward_keeps_its_beta_in_the_run_state_as_verl_s_controller():
    """--kl-target: --kl-in-reward's β is the run's state, read by the step and moved for the next by verl 0.9.1's
    AdaptiveKLController (Ziegler et al. 2019 §2.2: β ×= 1 + clip(KL / target - 1, ±0.2)·M / horizon, horizon
    1e4, M the step's rows, KL the mean over rows of their token means of log π_old/π_ref), 3 steps on
    peer_inputs: verl's own class and apply_kl_penalty's KL (0.0880434901629468) gave the values below. Each
    step's rewards use its β: the advantages move with it. Without --kl-target β stays, and is not in the state
    when --kl-in-reward is off."""
    x = peer_inputs()
    inputs = dict(old_logp=x["old_logp"], ref_logp=x["ref_logp"])
    for target, want in ((0.1, [0.05, 0.049997608698032596, 0.04999521751043169, 0.049992826437191815]),
                         (2.0, [0.05, 0.049996000000000006, 0.04999200032000001, 0.04998800095997441])):
        a, state, advs = grpo.Args(num_generations=2, kl_in_reward=0.05, kl_target=target), {}, []
        for t in range(3):
            _, row_adv, _, _, _, stats, _ = step(a, [1.0, 1.0, 0.0, 0.0], x["mask"], state, **inputs)
            assert stats["kl/in_reward_coef"] == want[t] and state == {"kl_in_reward": want[t + 1]}
            kl = ((x["old_logp"] - x["ref_logp"]) * x["mask"]).sum(-1)
            R = (torch.tensor([1.0, 1, 0, 0]) - want[t] * kl).view(2, 2)
            assert row_adv.tolist() == pytest.approx((R - R.mean(1, keepdim=True)).div(R.std(1, keepdim=True)
                                                                                     + 1e-6).flatten().tolist())
            advs.append(row_adv)
        assert not torch.equal(advs[0], advs[2])
    fixed = {}
    step(grpo.Args(num_generations=2, kl_in_reward=0.05), [1.0, 1.0, 0.0, 0.0], x["mask"], fixed, **inputs)
    step(grpo.Args(num_generations=2), [1.0, 1.0, 0.0, 0.0], x["mask"], off := {}, **inputs)
    assert fixed == {"kl_in_reward": 0.05} and off == {}


def test_kl_in_reward_by_hand_and_against_verl():
    """R_i -= beta sum_t (log pi_old - log pi_ref) over o_i's tokens (verl's use_kl_in_reward, kl_penalty "kl"),
    before the advantage: equal task rewards are no longer equal, so that group is not flat. Then verl 0.9.1
    apply_kl_penalty (beta 0.05) and compute_grpo_outcome_advantage on peer_inputs (uids x x y y)."""
    a = grpo.Args(num_generations=2, scale="none", kl_in_reward=0.5)
    old = torch.tensor([[-1.0, -1.0, 9.0], [-1.0, -2.0, 9.0]])  # the pad (9.0) counts nowhere
    ref = torch.tensor([[-1.1, -1.1, 0.0], [-1.0, -2.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    _, row_adv, _, _, flat, stats, _ = step(a, [1.0, 1.0], mask, old_logp=old.double(), ref_logp=ref.double())
    # KL sums 0.2 and 0: R = 0.9, 1.0, mean 0.95
    assert row_adv.tolist() == pytest.approx([-0.05, 0.05]) and not flat.any()
    assert stats["kl/in_reward"] == pytest.approx(0.1)
    x = peer_inputs()
    a = grpo.Args(num_generations=2, kl_in_reward=0.05)
    _, row_adv, _, _, _, stats, _ = step(a, [1.0, 0.0, 1.0, 0.0], x["mask"], old_logp=x["old_logp"],
                                      ref_logp=x["ref_logp"])
    R = torch.tensor([0.983939164876938, 0.031090469658374784, 0.9837202616035938, -0.020690086483955386])
    assert stats["kl/in_reward"] == pytest.approx(((torch.tensor([1.0, 0, 1, 0]) - R) / 0.05).mean().item())
    assert row_adv.tolist() == pytest.approx([0.7071057317035385, -0.7071057317035384, 0.7071057855789317,
                                              -0.7071057855789317], abs=1e-12)


# ----------------------------------------------------------------------------- what a term needs before the step
@pytest.mark.parametrize("kw, reads, skip", [
    (dict(), set(), True),  # one update, beta 0: no extra forward at all
    (dict(entropy_coef=0.01), set(), False),  # the bonus has a gradient at A = 0: equal-reward groups train
    (dict(opsm_delta=0.5), set(), True), (dict(tis=2.0, tis_mode="sequence_mask", tis_min=0.5), set(), True),
    (dict(top_entropy_quantile=0.2), {"old_entropy"}, True), (dict(kl_in_reward=0.01), {"old_logp", "ref_logp"}, True),
    (dict(surrogate="gmpo"), set(), True), (dict(surrogate="vespo"), set(), True),
    (dict(surrogate="kl_cov"), set(), True), (dict(surrogate="clip_cov"), set(), True),
    (dict(adv_estimator="gdpo"), set(), True), (dict(adv_estimator="reinforce_plus_plus_baseline"), set(), True),
    (dict(num_iterations=2), {"old_logp"}, True), (dict(beta=0.04), {"ref_logp"}, False),
])
def test_probe_says_what_each_variant_reads_and_whether_flat_groups_may_be_skipped(kw, reads, skip):
    """probe(args): the step inputs a term reads (old_entropy for the entropy quantile, old_logp and ref_logp for
    the KL in the reward, old_logp for several updates, ref_logp for beta), none at one update without beta, and
    whether the gradient at A = 0 is 0 (then an equal-reward group's forward/backward is skipped)."""
    got, skipped, _ = grpo.probe(grpo.Args(**kw))
    assert got == reads and skipped == skip
    assert not grpo.probe(grpo.Args(**kw, skip_zero_variance=False))[1]  # --no-skip-zero-variance: never


def test_evaluate_reports_greedy_mean_and_pass_at_k(loaded, monkeypatch):
    """Prompts with known numbers of right samples (0, 1 and 3 of 4): mean@4, pass@2, pass@4 by hand."""
    a, model, tok = loaded
    a = replace(a, eval_samples=4)
    right = {"p0": 0, "p1": 1, "p2": 3}  # right sampled answers per prompt; greedy is right on p2 only

    def fake_generate(model, tok, rows, a, greedy=False, sampler=None, tools=None):
        for j, r in enumerate(rows):
            p = r["record"]["prompt"]
            i = sum(q["record"] is r["record"] for q in rows[:j])  # the row's place in its prompt's
            answer = ("7" if greedy and p == "p2" else "0") if greedy else ("7" if i < right[p] else "0")
            r["completion"] = torch.tensor(tok(answer, add_special_tokens=False).input_ids)
            r["text"] = tok.decode(r["completion"], skip_special_tokens=True)
        return rows
    monkeypatch.setattr(grpo, "generate", fake_generate)
    got = grpo.evaluate(model, tok, [{"prompt": p, "answer": "7"} for p in right], a, 0, 1)
    pass2 = (0 + (1 - 3 / 6) + 1) / 3  # C(3,2)/C(4,2) = 3/6 pairs miss the one right answer; 3 right: never
    assert got == pytest.approx({"eval/accuracy": 1 / 3, "eval/mean@4": (0 + 1 + 3) / 12, "eval/pass@2": pass2,
                                 "eval/pass@4": 2 / 3})


def problem(ex):
    """An arithmetic_task problem's operation and numbers, read back from its text: (op, sorted numbers)."""
    import re
    op = next(o for word, o in {"gets": "+", "gives away": "-", "boxes": "*", "shares": "/"}.items()
              if word in ex["prompt"])
    x, y = map(int, re.findall(r"\d+", ex["prompt"])[:2])
    if op == "/":
        return op, (x, y)  # x shared among y
    return op, tuple(sorted((x, y)))


def test_the_built_in_task_holds_out_problems_not_wordings():
    """No held-out problem has the operation and numbers of a training problem, in any wording, and the
    held-out split is the same whatever --eval-prompts or --seed (so training is too, on --resume)."""
    train, evals = grpo.load_data(grpo.parse_args(["--eval-prompts", "1000"]))
    assert len(evals) == 1000 == len({problem(e) for e in evals})  # each held-out problem once
    assert not {problem(e) for e in evals} & {problem(t) for t in train}
    assert {problem(e)[0] for e in evals} == {"+", "-", "*", "/"}
    assert all(R.correct(f"\\boxed{{{ex['answer']}}}", ex["answer"]) == 1 for ex in evals)
    other_train, other_evals = grpo.load_data(grpo.parse_args(["--eval-prompts", "64", "--seed", "3"]))
    assert other_evals == evals[:64] and not {problem(e) for e in evals} & {problem(t) for t in other_train}
    assert grpo.load_data(grpo.parse_args(["--eval-prompts", "8"]))[0] == train  # training never depends on it


def test_the_built_in_task_beside_an_eval_dataset_larger_than_its_held_out_part(tmp_path):
    """--eval-dataset replaces the built-in held-out problems: --eval-prompts may exceed their 2900 then (it
    was refused, and the held-out problems built for nothing: 5000 would never have ended)."""
    data = write(tmp_path / "e.jsonl", [f'{{"prompt": "{i} + 1?", "answer": "{i + 1}"}}' for i in range(3000)])
    train, evals = grpo.load_data(grpo.parse_args(["--eval-dataset", data, "--eval-prompts", "5000"]))
    assert len(train) == 20000 and [e["answer"] for e in evals] == [str(i + 1) for i in range(3000)]


@pytest.mark.parametrize("pad", [2, 0])  # pad == eos, pad != eos
def test_completion_mask_keeps_first_eos(pad):
    eos = 2
    ids = torch.tensor([[5, 6, eos, pad, pad], [5, eos, 7, eos, pad], [5, 6, 7, 8, 9], [eos, pad, pad, pad, pad]])
    mask = grpo.completion_mask(ids, [eos])
    assert mask.int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]


def test_completion_mask_several_eos_ids():
    mask = grpo.completion_mask(torch.tensor([[4, 9, 3, 3], [4, 3, 9, 9]]), [3, 9])
    assert mask.int().tolist() == [[1, 1, 0, 0], [1, 1, 0, 0]]


# ============================================================================= rewards
# (completion, reference, intended grade): how models write final answers, each class right and wrong
ANSWER_STYLES = [
    # GSM8K style
    ("Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether.\n#### 72", "72", True),
    ("Natalia sold 48+24 = 72 clips.\n#### 71", "72", False),
    ("Natalia sold 48 clips.\n#### 72", "72", True),
    ("Q: what?\nA: 7 apples", "7", True),
    ("She makes 9 * 2 = $18 every day.\nA: 18", "18", True),
    ("She makes 13 * 2 = $26 every day.\nA: 26", "18", False),
    ("He ran 3*3=<<3*3=9>>9 sprints, so 9*60=<<9*60=540>>540 meters.\nA: 540", "540", True),
    ("The answer is 1,234.", "1234", True),
    ("The answer is 1,234.", "1,234", True),
    ("The answer is 1234.", "1,235", False),
    ("I think the answer is $18.00.", "18", True),
    ("The answer is: -3", "-3", True),
    ("The answer is: 3", "-3", False),
    ("first 3, then 4, finally 12", "12", True),
    ("first 12, then 4, finally 3", "12", False),
    ("So she has 5 apples left. The answer is 5 apples.", "5", True),
    ("The final answer is 70,000 dollars.", "70000", True),
    ("The final answer is $70,000.", "70000", True),
    ("The final answer is $69,000.", "70000", False),
    ("Therefore, the answer is 25%.", "25", True),
    ("#### 7 apples", "7", True),
    ("answer: 7.0", "7", True),
    ("answer: 7.5", "7", False),
    ("The answer is 0.5", "1/2", True),
    ("The answer is .5", "0.5", True),
    # \boxed, \frac, \dfrac, percentages, units, currency
    ("so the total is \\boxed{42}.", "42", True),
    ("so the total is \\boxed{41}.", "42", False),
    ("\\boxed{\\frac{3}{4}}", "0.75", True),
    ("\\boxed{\\frac34}", "3/4", True),
    ("\\boxed{\\dfrac{10}{4}}", "2.5", True),
    ("\\boxed{\\tfrac{1}{3}}", "0.33", False),
    ("\\boxed{1,000}", "1000", True),
    ("\\boxed{\\$1,250}", "1250", True),
    ("\\boxed{\\$1,250.50}", "1250", False),
    ("\\boxed{25\\%}", "25", True),
    ("\\boxed{3/6}", "1/2", True),
    ("\\boxed{12 \\text{ cm}}", "12", True),
    ("\\boxed{12\\text{cm}^2}", "12", True),
    ("\\boxed{90^\\circ}", "90", True),
    ("\\boxed{-\\frac{1}{2}}", "-0.5", True),
    ("\\boxed{\\frac{1}{2}}", "-0.5", False),
    ("$\\boxed{5}$ dollars", "5", True),
    ("\\boxed{\\text{5 dollars}}", "5", True),
    ("\\boxed{1/0}", "0", False),
    # mixed numbers
    ("\\boxed{12 \\frac{3}{5}}", "12\\frac{3}{5}", True),
    ("\\boxed{\\frac{63}{5}}", "12\\frac{3}{5}", True),
    ("\\boxed{12.6}", "12\\frac{3}{5}", True),
    ("\\boxed{\\frac{123}{5}}", "12\\frac{3}{5}", False),
    ("\\boxed{12}", "12\\frac{3}{5}", False),
    ("\\boxed{1\\frac{1}{4}}", "1.25", True),
    ("\\boxed{1\\frac{1}{4}}", "5/4", True),
    ("\\boxed{1\\frac{1}{4}}", "11/4", False),
    ("The answer is 2 1/2 cups.", "2.5", True),
    ("\\boxed{-1\\frac{1}{2}}", "-1.5", True),
    # LaTeX thousands separators and spacing
    ("\\boxed{10{,}000}", "10000", True),
    ("\\boxed{10{,}000}", "10", False),
    ("\\boxed{1\\,450\\,000}", "1450000", True),
    ("\\boxed{1\\,450\\,000}", "1450", False),
    ("\\boxed{1,450,000}", "1450000", True),
    ("The answer is $1\\,000$.", "1000", True),
    ("\\boxed{ 42 }", "42", True),
    ("\\boxed{\\left( 42 \\right)}", "42", True),
    # non-numeric references (MATH style)
    ("\\boxed{A}", "A", True),
    ("\\boxed{B}", "A", False),
    ("\\boxed{(2, 3)}", "(2, 3)", True),
    ("\\boxed{(2,3)}", "(2, 3)", True),
    ("\\boxed{(3, 2)}", "(2, 3)", False),
    ("\\boxed{x^2 + 1}", "x^2+1", True),
    ("\\boxed{x^2 + 2}", "x^2+1", False),
    ("\\boxed{\\frac{\\pi}{2}}", "\\pi/2", True),
    ("\\boxed{\\dfrac{\\pi}{2}}", "\\frac{\\pi}{2}", True),
    ("\\boxed{\\frac{\\pi}{3}}", "\\frac{\\pi}{2}", False),
    ("\\boxed{[0, 1)}", "[0, 1)", True),
    ("\\boxed{[0, 1]}", "[0, 1)", False),
    ("\\boxed{\\left[0, 1\\right)}", "[0,1)", True),
    ("\\boxed{\\text{Tuesday}}", "\\text{Tuesday}", True),
    ("\\boxed{\\text{Monday}}", "\\text{Tuesday}", False),
    ("The answer is $2\\sqrt{3}$.", "2\\sqrt{3}", True),
    ("The answer is $3\\sqrt{2}$.", "2\\sqrt{3}", False),
    ("\\boxed{3\\sqrt{2}}", "3", False),
    ("\\boxed{2\\sqrt3}", "2\\sqrt{3}", True),
    ("\\boxed{x = 5}", "5", True),
    ("\\boxed{y=2x+3}", "2x+3", True),
    # multiple choice
    ("The correct option is (B).\n\\boxed{B}", "B", True),
    ("\\boxed{(B)}", "B", True),
    ("\\boxed{B}", "(B)", True),
    ("\\boxed{B}", "(b)", True),
    ("The answer is (C) 12.", "C", True),
    ("The answer is (C) 12.", "B", False),
    ("Answer: D", "D", True),
    ("Answer: D", "A", False),
    ("\\boxed{\\text{(E)}}", "E", True),
    ("The answer is B.", "B", True),
    # the first number is not the answer
    ("\\boxed{4a-3}", "4a-2", False),
    ("\\boxed{4a-2}", "4a-2", True),
    ("\\boxed{4a-3}", "4", False),
    ("\\boxed{9 \\times 2 = 18}", "18", True),
    ("\\boxed{9 \\times 2 = 18}", "9", False),
    ("So the answer is 35+28+14=77 sandwiches.", "77", True),
    ("So the answer is 35+28+14=77 sandwiches.", "35", False),
    ("The answer is 3 + 4 = 7.", "7", True),
    ("\\boxed{2^{10}}", "2", False),
    ("\\boxed{5x}", "5", False),
    # text after the answer
    ("The answer is 80.\n\nQ: Tom has 4 boxes of 10 pencils. How many pencils?\nA: 40 pencils", "80", True),
    ("The answer is 80.\n\nQ: Tom has 4 boxes of 10 pencils. How many pencils?\nA: 40 pencils", "40", False),
    ("The book is 188 pages long, so the answer is 188. Each page is 50 mm thick.", "188", True),
    ("The book is 188 pages long, so the answer is 188. Each page is 50 mm thick.", "50", False),
    ("At first I thought the answer is not possible. But 2 + 3 = 5, so the total is 5.", "5", True),
    ("At first I thought the answer is not possible. But 2 + 3 = 5, so the total is 5.", "2", False),
    ("The answer is 12, which is 3 more than 9.", "12", True),
    ("The answer is 12, which is 3 more than 9.", "9", False),
    ("The answer is 6 (3 from each bag).", "6", True),
    # tags
    ("<think>maybe \\boxed{7}</think><answer>9</answer>", "9", True),
    ("<think>maybe \\boxed{7}</think><answer>9</answer>", "7", False),
    ("<think>5+5</think><answer>10</answer>", "10", True),
    ("Maybe \\boxed{3}. <answer>4</answer>", "4", True),  # the tag wins over a box
    ("Maybe \\boxed{3}. <answer>4</answer>", "3", False),
    ("<think>the answer is 3? no, 4</think>\nSo the final answer is \\boxed{4}.", "4", True),
    ("<think>the answer is 3? no, 4</think>\nSo the final answer is \\boxed{4}.", "3", False),
    ("<think>\\boxed{12}</think> It is 13.", "13", False),
    ("<think>\\boxed{12}</think> The answer is 13.", "13", True),
    ("<answer>(2, 3)</answer>", "(2,3)", True),
    ("<think>\\boxed{7}?</think> The answer is 12 apples and 3 pears.", "12", True),  # the box in thinking is no answer
    # nothing to grade
    ("no number at all", "42", False),
    ("\\boxed{}", "42", False),
    ("", "42", False),
    ("the answer is 42 but \\boxed{41}", "42", False),
    ("\\boxed{41} but the answer is 42", "41", True),
    # a self-correction: the last answer is the final one
    ("\\boxed{3}. No, I made an error: \\boxed{4}", "4", True),
    ("\\boxed{3}. No, I made an error: \\boxed{4}", "3", False),
    ("\\fbox{12}", "12", True),
    ("\\boxed{3}, or rather \\fbox{5}", "5", True),
    ("\\boxed{3}, or rather \\fbox{5}", "3", False),
    ("So \\boxed{5}, and finally \\boxed{6", "5", True),  # the last box never closed (cut off): the one before
    ("<answer>3</answer> No: <answer>4</answer>", "4", True),
    ("<answer>3</answer> No: <answer>4</answer>", "3", False),
    ("#### 3\nNo, I miscounted.\n#### 4", "4", True),
    ("#### 3\nNo, I miscounted.\n#### 4", "3", False),
    ("The answer is 3.\nNo, wait: the answer is 4.", "4", True),
    ("The answer is 3.\nNo, wait: the answer is 4.", "3", False),
    ("The answer is 3. No, wait: the answer is 4.", "4", True),  # the last phrase of a line
    # the less common shapes of each path: signs, fractions, decimals (the last number: no phrase, box or tag)
    ("first 3, then 4, finally -12", "-12", True),
    ("first 3, then 4, finally -12", "12", False),
    ("first 3, then 4, finally \u221212", "-12", True),  # a Unicode minus sign, as models write it
    ("first 3, then 4, finally \u221212", "12", False),
    ("so each gets 3/4", "0.75", True),
    ("so each gets 3/4", "4", False),
    ("so each gets -3/4", "-0.75", True),
    ("It went from 5 to -2.5 degrees", "-2.5", True),
    ("It went from 5 to -2.5 degrees", "2.5", False),
    ("The answer is -5 apples and 3 pears.", "-5", True),  # a phrase's first number, with its sign
    ("The answer is -5 apples and 3 pears.", "5", False),
    ("The answer is 5 apples and 3 pears.", "5", True),
    ("The answer is 5 apples and 3 pears.", "3", False),
    ("#### -8", "-8", True),
    ("#### 8", "-8", False),
    ("<answer>-2</answer>", "-2", True),
    ("<answer>2</answer>", "-2", False),
    ("<answer>3/4</answer>", "0.75", True),
    ("\\boxed{-12}", "12", False),
]


@pytest.mark.parametrize("completion, reference, right", ANSWER_STYLES, ids=lambda x: repr(x)[:40] if isinstance(x, str) else str(x))
def test_correct_grades_each_answer_style(completion, reference, right):
    assert R.correct(completion, reference) == float(right)
    assert R.correct_pm1(completion, reference) == (1.0 if right else -1.0)


def test_math_verify_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install math-verify"):
        R.math_verify("\\boxed{1}", "1")


def test_math_verify_grades_the_final_answer():
    pytest.importorskip("math_verify")
    assert R.math_verify("<think>\\boxed{7}</think> so \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert R.math_verify("\\boxed{\\sqrt{8}}", "2\\sqrt{2}") == 1.0  # equivalent forms: beyond `correct`
    assert R.math_verify("\\boxed{4a-3}", "4a-2") == 0.0


def test_gsm8k_reference_answer():
    assert R.reference_answer("She has 3 + 4 = <<3+4=7>>7 ...\n#### 1,234") == "1,234"
    assert R.reference_answer("#### 3 is wrong: 3 + 1 = 4\n#### 4") == "4"  # the last
    assert R.correct("\\boxed{1234}", R.reference_answer("x\n#### 1,234")) == 1.0


@pytest.mark.parametrize("text, want", [
    ("<think>a</think>\n<answer>3</answer>", 1.0), ("<reasoning>a</reasoning>\n<answer>3</answer>", 1.0),
    ("  <think>a</think><answer>3</answer>\n", 1.0), ("<think>a</think> trailing <answer>3</answer>", 0.0),
    ("<answer>3</answer>", 0.0), ("<reasoning>a</think><answer>3</answer>", 0.0),
    ("Sure. <think>a</think><answer>3</answer>", 0.0), ("<think>a</think><answer>3</answer> Done.", 0.0),
    ("<think>a</think><answer>3", 0.0),
    ("<think>\nStep 1: 1 + 2 = 3.\n\nStep 2: done.\n</think>\n<answer>\n3\n</answer>", 1.0),  # thinking on lines
    ("<reasoning>line 1\nline 2</reasoning><answer>3</answer>", 1.0),
    ("<think>a\nb</think>\nso <answer>3</answer>", 0.0)])
def test_format_reward(text, want):
    assert R.r1_format(text, "3") == R.REWARDS["format"](text, "3") == want


def text_rows(texts, records, lengths):
    """Rows as score reads them: a completion's text, its record, and a completion of `length` tokens."""
    return [dict(record=ex, text=t, completion=[0] * n) for t, ex, n in zip(texts, records, lengths)]


def test_the_registry_and_the_weights_reach_the_reward():
    """--rewards names map to the functions README describes, and each is weighted: R = sum_k w_k r_k."""
    assert (R.REWARDS["correct"]("\\boxed{2}", "3"), R.REWARDS["correct_pm1"]("\\boxed{2}", "3")) == (0.0, -1.0)
    fns = grpo.build_rewards(grpo.parse_args(["--rewards", "correct:0.5,correct_pm1:2,format:0.25"]))
    text = "<think>1+2</think><answer>3</answer>"
    total, per_fn = grpo.score(text_rows([text, "\\boxed{4}"], [{"prompt": "1+2?", "answer": "3"}] * 2, [9, 5]),
                                  fns, grpo.parse_args([]))
    assert {k: v.tolist() for k, v in per_fn.items()} == {"correct": [1, 0], "correct_pm1": [1, -1], "format": [1, 0]}
    assert total.tolist() == [0.5 + 2 + 0.25, -2.0]


def test_cosine_reward_by_hand_and_against_trl():
    """Demystifying Long CoT (2502.03373) App. C.1 with TRL 1.16.0 get_cosine_scaled_reward(max_len=100)'s
    defaults: v = lo + (hi - lo)(1 + cos(pi min(L / L_max, 1))) / 2, (lo, hi) = (0.5, 1) if correct else
    (-0.5, -1). TRL's values at lengths 0, 0, 50, 50, 150 (correct, wrong, ...): 1, -1, 0.75, -0.75, 0.5."""
    right, wrong = "so \\boxed{3}", "so \\boxed{4}"
    got = [R.cosine(text, "3", length=n, max_length=100)
           for text, n in ((right, 0), (wrong, 0), (right, 50), (wrong, 50), (right, 150))]
    assert got == pytest.approx([1.0, -1.0, 0.75, -0.75, 0.5])
    c = math.cos(math.pi / 4)  # length 25 of 100
    assert R.cosine(right, "3", length=25, max_length=100) == pytest.approx(0.5 + 0.25 * (1 + c))
    assert R.cosine(wrong, "3", length=25, max_length=100) == pytest.approx(-0.5 - 0.25 * (1 + c))
    assert R.cosine(wrong, "3", length=10 ** 6, max_length=100) == -0.5  # past L_max: L_max's value
    assert R.REWARDS["cosine"] is R.cosine and R.cosine.reads_answer
    a = grpo.parse_args(["--rewards", "cosine", "--max-new-tokens", "100"])  # T is L_max
    total, _ = grpo.score(text_rows([right, wrong], [{"prompt": "1+2?", "answer": "3"}] * 2, [50, 100]),
                             grpo.build_rewards(a), a)
    assert total.tolist() == pytest.approx([0.75, -0.5])


def test_repetition_reward_by_hand_and_against_trl():
    """Demystifying Long CoT (2502.03373) App. C.2, open-r1's: (1 - unique / total 3-grams of the lower-cased
    whitespace words) * -1, 0 under 3 words. The values are TRL 1.16.0 get_repetition_penalty_reward(ngram_size=3,
    max_penalty=-1)'s, given these texts' lower-cased word lists as its token ids."""
    texts = ["the cat sat on the mat", "a a a a a a", "Go go GO go go\nGO", "one two", "",
             "x y z x y z x", "so so so so so so so so so so"]
    trl = [0.0, -0.75, -0.75, 0.0, 0.0, -0.4, -0.875]
    # 'a a a a a a': 4 trigrams, 1 unique: -(1 - 1/4); 'x y z x y z x': xyz yzx zxy xyz yzx, 3 of 5 unique: -0.4
    assert [R.repetition(t, "") for t in texts] == pytest.approx(trl)
    assert R.REWARDS["repetition"] is R.repetition and not getattr(R.repetition, "reads_answer", False)


def test_repetition_reward_s_parameters_each_change_its_value_by_hand():
    """Texts whose n-gram counts differ with n, so that a reward counting other n-grams than asked (2-word grams for
    the default 3), or a max_penalty not applied, fails. 'a b a b a': 2-grams ab ba ab ba (2 of 4 unique), 3-grams
    aba bab aba (2 of 3), 4-grams abab baba (2 of 2); 'x y x y x y': 2-grams 2 of 5 unique, 3-grams 2 of 4."""
    assert R.repetition("a b a b a", "") == pytest.approx(-(1 - 2 / 3))  # n = 3 by default, max_penalty -1
    assert R.repetition("a b a b a", "", ngram_size=2) == pytest.approx(-(1 - 2 / 4))
    assert R.repetition("a b a b a", "", ngram_size=4) == 0.0
    assert R.repetition("a b a b a", "", ngram_size=6) == 0.0  # fewer words than n
    assert R.repetition("x y x y x y", "", max_penalty=-0.5) == pytest.approx(-0.5 * (1 - 2 / 4))
    assert R.repetition("x y x y x y", "", ngram_size=2, max_penalty=-2.0) == pytest.approx(-2.0 * (1 - 2 / 5))
    fns = grpo.build_rewards(grpo.parse_args(["--rewards", "repetition:2"]))  # the registry's, weighted
    total, _ = grpo.score(text_rows(["a b a b a", "x y x y x y"], [{"prompt": "p", "answer": ""}] * 2, [5, 6]), fns,
                             grpo.parse_args([]))
    assert total.tolist() == pytest.approx([-2 * (1 - 2 / 3), -2 * (1 - 2 / 4)])
    assert R.cosine("so \\boxed{3}", "3", length=128) == pytest.approx(0.75)  # cosine's own L_max: 256, half way


def test_overlong_penalty_by_hand(tmp_path):
    """DAPO (2503.14476) eq. 13 with L_max = 10, L_cache = 4: 0 up to 6 tokens, then (6 - |o|) / 4 down to
    -1 at 10 tokens, -1 beyond."""
    got = [R.overlong_penalty(4, "", "", length=n, max_length=10) for n in (1, 6, 7, 9, 10, 11, 500)]
    assert got == pytest.approx([0.0, 0.0, -0.25, -0.75, -1.0, -1.0, -1.0])
    a = grpo.parse_args(["--algo", "dapo", "--max-new-tokens", "10", "--overlong-buffer", "4"])
    fns = [f for f in grpo.build_rewards(a) if f[0] == "overlong"]  # a reward; L_cache bound by place:
    ex = grpo.load_examples(write(tmp_path / "d.jsonl", ['{"prompt": "q", "answer": "1", "buffer": 1}']), "train",
                            False, fns, grpo.reward_keywords(a))  # a record's field `buffer` is the record's
    assert grpo.score(text_rows(["x"], ex, [9]), fns, a)[0].item() == -0.75


@pytest.mark.parametrize("text", [
    "9" * 1_000_000, "\\boxed{" + "9" * 100_000 + "}", "1e999999", "{" * 200_000 + "\\boxed{" * 1000,
    "\n" * 500_000 + "A", "<answer>" * 100_000, "__import__('os').system('echo pwned') \\boxed{__import__('os')}",
    "\\boxed{2**10**10}", "#" * 300_000, "</think>" * 100_000 + "<answer>", "٣٤ ½ ∞ \\boxed{\u0663}", "1/0",
    "\\boxed{" * 10_000, "\\boxed{" + "{" * 100_000 + "}" * 100_000, "\\boxed{9^{9^{9^{9^{9}}}}}",
    "the answer is " + "9" * 1_000_000, "answer is" + " " * 1_000_000 + "5", "\n\n" * 300_000 + "Q:",
    "\\frac{" * 50_000 + "1}{2}", ("12,345" * 100_000)[:300_000], "\\boxed{1}" + "\\text{" * 100_000,
], ids=lambda t: repr(t[:12]) + f"x{len(t)}")
def test_adversarial_text_is_finite_and_fast(text):
    """Linear time: each text takes milliseconds. A regex gone super-linear would take hours, not seconds, so a
    deadline of a minute (an alarm, not a stopwatch) turns such a hang into a failure on any machine."""
    def hang(*_):
        raise TimeoutError(f"grading {text[:12]!r}... (len {len(text)}) still ran after 60 s: super-linear")
    signal.signal(signal.SIGALRM, hang)
    signal.alarm(60)
    try:
        for fn in (R.correct, R.correct_pm1, R.r1_format, R.cosine, R.repetition):  # math_verify: see README
            assert math.isfinite(fn(text, "42"))
    finally:
        signal.alarm(0)


def test_reward_functions_get_the_record_s_fields_and_the_length(tmp_path):
    """As in TRL: the completion, the answer, and every other field of the record as keywords; and `length`, the
    completion's tokens, and `max_length`, T (a token-length reward needs no edit of grpo.py)."""
    a = grpo.parse_args([])
    seen = []
    fns = [("all", lambda c, ans, **kw: seen.append(("all", ans, kw)) or 1.0, 1.0),
           ("some", lambda c, ans, prompt, length, **kw: seen.append(("some", ans, prompt)) or length / 10, 1.0)]
    ex = {"prompt": "Write f.", "answer": "", "tests": ["assert f() == 1"]}
    total, _ = grpo.score(text_rows(["def f(): return 1"], [ex], [5]), fns, a)
    assert total.item() == 1.5
    assert seen == [("all", "", {"prompt": "Write f.", "tests": ["assert f() == 1"], "length": 5, "max_length": 256}),
                    ("some", "", "Write f.")]
    assert grpo.load_examples(write(tmp_path / "d.jsonl", [json.dumps(ex)]), "train", False, fns, grpo.reward_keywords(a)) == [ex]
    only = [("only", lambda c, ans, *, tests, **kw: float(len(tests)), 1.0)]  # keyword-only, no default: the record's
    assert grpo.load_examples(write(tmp_path / "d.jsonl", [json.dumps(ex)]), "train", False, only) == [ex]
    assert grpo.score(text_rows(["x"], [ex], [1]), only, a)[0].item() == 1.0
    with pytest.raises(SystemExit, match="reward 'none' raised TypeError: .*unexpected keyword argument 'prompt'"):
        grpo.score(text_rows(["x"], [ex], [1]), [("none", lambda c, ans: 3.0, 1.0)], a)


@pytest.mark.parametrize("line, says", [
    ({"prompt": "p", "answer": "1"}, "missing a required argument: 'tests'"),
    ({"prompt": "p", "answer": "1", "tests": [], "length": 3}, "multiple values for keyword argument 'length'")])
def test_a_record_without_a_field_the_reward_needs_is_named_at_start(tmp_path, line, says):
    """A custom reward's required keyword is a field every record must have: the file and line say which lacks it,
    before the model loads, not at the step that draws the record. `length` is the completion's, never a field."""
    data = write(tmp_path / "d.jsonl", [json.dumps({"prompt": "q", "answer": "1", "tests": ["t"]}), json.dumps(line)])
    (tmp_path / "rw.py").write_text("def r(completion, answer, tests, **kw):\n    return float(len(tests))\n")
    with pytest.raises(SystemExit, match=f"d.jsonl:2: reward 'r' cannot take this record's fields and length, max_length: .*{says}"):
        main(["--dataset", data, "--reward-fn", f"{tmp_path}/rw.py:r", "--model", "no-such/model",
              "--output-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("rewards, field", [("cosine", "max_length"), ("repetition", "max_penalty"),
                                            ("repetition", "ngram_size"), ("mine", "max_length"), ("mine", "scale")])
def test_a_record_field_never_sets_a_reward_s_own_parameter(tmp_path, rewards, field):
    """A keyword-only parameter is the reward's own: a built-in's (repetition's max_penalty: 5 would make it a
    bonus), or one grpo.py passes every reward (T as max_length, as length). A record with a field of that name
    is refused at load, naming the field and the reward, never passed on. Other fields reach a custom reward's
    parameters as in TRL, and a field one reward does not own may be another's."""
    (tmp_path / "rw.py").write_text("def mine(c, a, level=0, max_length=1, *, scale=1.0, **kw):\n"
                                    "    return scale * level + max_length\n")
    argv = ["--rewards", rewards] if rewards != "mine" else ["--reward-fn", f"{tmp_path}/rw.py:mine"]
    a = grpo.parse_args(argv + ["--max-new-tokens", "40"])
    fns = grpo.build_rewards(a)
    data = write(tmp_path / "d.jsonl", ['{"prompt": "q", "answer": "1", "level": 2}',
                                        json.dumps({"prompt": "q", "answer": "1", field: 5})])
    with pytest.raises(SystemExit, match=f"d.jsonl:2: reward '{rewards}' cannot take this record's fields and length, max_length: .*"
                                         f"multiple values for keyword argument '{field}'"):
        grpo.load_examples(data, "train", False, fns, grpo.reward_keywords(a))
    others = {"max_length": "max_penalty", "max_penalty": "x", "ngram_size": "x", "scale": "x"}
    data = write(tmp_path / "d.jsonl", ['{"prompt": "q", "answer": "1", "level": 2}',
                                        json.dumps({"prompt": "q", "answer": "1", others[field]: 5})])
    examples = grpo.load_examples(data, "train", False, fns, grpo.reward_keywords(a))
    total, _ = grpo.score(text_rows(["a a a a a a"] * 2, examples, [20, 20]), fns, a)
    want = {"cosine": [-0.75, -0.75], "repetition": [-0.75, -0.75], "mine": [2 + 40, 40]}[rewards]
    assert total.tolist() == pytest.approx(want)  # cosine at T = 40: 20 tokens is half way; 4 trigrams, 1 unique


def test_which_rewards_read_the_answer_is_marked_on_the_reward(tmp_path):
    """A reward marked reads_answer (the built-in graders, or a custom one) needs a non-empty answer in every
    record; an unmarked one does not: no list of names to keep in step."""
    data = write(tmp_path / "d.jsonl", ['{"prompt": "write f", "answer": ""}'])
    mine = lambda c, ans, **kw: 1.0  # noqa: E731
    assert grpo.load_data(grpo.parse_args(["--dataset", data]), [("mine", mine, 1.0)])[0][0]["answer"] == ""
    for fn in (R.reads_answer(lambda c, ans, **kw: 1.0), R.correct, R.correct_pm1, R.math_verify):
        with pytest.raises(SystemExit, match="d.jsonl:1: each line needs a prompt .* and an answer"):
            grpo.load_data(grpo.parse_args(["--dataset", data]), [("f", fn, 1.0)])
    assert not getattr(R.r1_format, "reads_answer", False)
    cosine = grpo.build_rewards(grpo.parse_args(["--rewards", "cosine"]))  # bound to T, still marked
    with pytest.raises(SystemExit, match="d.jsonl:1: each line needs a prompt .* and an answer"):
        grpo.load_data(grpo.parse_args(["--dataset", data]), cosine)


def test_custom_reward_alone_unless_rewards_given(tmp_path):
    (tmp_path / "rw.py").write_text("def length(c, a, **kw):\n    return len(c) / 10\n")
    a = grpo.parse_args(["--reward-fn", f"{tmp_path}/rw.py:length"])
    assert [n for n, _, _ in grpo.build_rewards(a)] == ["length"]
    a = grpo.parse_args(["--reward-fn", f"{tmp_path}/rw.py:length", "--rewards", "correct: 1, format :0.5"])
    fns = grpo.build_rewards(a)  # spaces around the names and weights are fine
    assert [(n, w) for n, _, w in fns] == [("correct", 1.0), ("format", 0.5), ("length", 1.0)]
    total, per_fn = grpo.score(text_rows(["\\boxed{3} xx"], [{"prompt": "1+2?", "answer": "3"}], [5]), fns, a)
    assert total.item() == pytest.approx(1.0 + 0 + 1.2) and per_fn["length"].item() == pytest.approx(1.2)


@pytest.mark.parametrize("value, says", [
    ("float('nan')", "reward 'r' returned nan"), ("3.5e38", "reward 'r' returned 3.5e[+]?38"),
    ("None", "reward 'r' returned None: a reward is a number"), ("'0.5'", "reward 'r' returned '0.5': a reward"),
    ("[1.0]", r"returned \[1.0\]"), ("1 / 0", "reward 'r' raised ZeroDivisionError: division by zero"),
    ("10 ** 400", "reward 'r' returned 1000000.*: a reward is a number, finite in float32"),
    ("__import__('sys').exit(3)", "reward 'r' raised SystemExit: 3")])
def test_a_reward_that_raises_or_returns_no_finite_number_stops_the_run_named(value, says):
    """float32 is the step's dtype: 3.5e38 is finite in Python and inf there."""
    fns = [("r", eval(f"lambda c, ans, **kw: {value}"), 1.0)]
    with pytest.raises(SystemExit, match=says):
        grpo.score(text_rows(["x"], [{"prompt": "p", "answer": "1"}], [1]), fns, grpo.parse_args([]))


def test_rewards_that_overflow_float32_in_the_advantages_are_refused():
    """Each of ±3e38 is finite in float32, but the group's std squares R - mean_g: std_g = inf, so every A = 0 and
    nothing trains, without a word; a group of two 3e38 overflows its mean (A = NaN); REINFORCE++'s whitening sums
    squares over tokens (1e20: every A = 0). Refused where the groups are chosen, before the step, by a bound on every
    float32 sum the advantages take: T (Σ|R|)². 1e16 trains."""
    a = grpo.parse_args([])
    adv, _ = grpo.group_advantages(torch.tensor([[3e38, -3e38]]))
    assert adv.tolist() == [[0.0, 0.0]]  # what would have trained
    s = {"reward": torch.tensor([1e20, 0.0, 1.0, 0.0]), "mask": torch.ones(4, 256)}  # rpp whitens Σ_t (A - mean)²
    rpp = grpo.step_terms(s, grpo.parse_args(["--adv-estimator", "reinforce_plus_plus_baseline", "--num-generations",
                                              "2"]), {})[0]["row_adv"][:, 0]
    assert rpp.tolist() == [0.0] * 4  # what would have trained: nothing, without a word
    for bad in ([[1.0, 0.0], [3e38, -3e38]], [[3e38, 3e38]], [[math.inf, 1.0]], [[1e20, 0.0], [1.0, 0.0]],
                [[math.nan, 1.0]]):
        with pytest.raises(SystemExit, match=r"^grpo: error: rewards up to (3e\+38|inf|1e\+20|nan) overflow float32 "
                                             r"in the advantages' sums \(T \(Σ\|R\|\)² over 3.4e38\): scale them"):
            grpo.select_groups(torch.tensor(bad), a)
    assert grpo.select_groups(torch.tensor([[1e16, -1e16], [1.0, 0.0]]), a)[0].tolist() == [0, 1]


def test_a_non_finite_reward_weight_stops_the_run():
    for w in ("nan", "inf", "x", "1e39"):  # 1e39: a finite float that float32 makes inf (inf x 0 = nan)
        with pytest.raises(SystemExit, match=f"weight '{w}' of 'correct' is not a number finite in float32"):
            grpo.build_rewards(grpo.parse_args(["--rewards", f"correct:{w}"]))
    with pytest.raises(SystemExit, match="unknown reward 'corect'"):
        grpo.build_rewards(grpo.parse_args(["--rewards", "corect"]))
    with pytest.raises(SystemExit, match="no reward: give --rewards and/or --reward-fn"):
        grpo.parse_args(["--rewards", " , "])


def test_a_reward_named_twice_is_refused(tmp_path):
    """reward/<name> is logged by name: a second `correct` would overwrite the first's metric, not its reward; a
    reward named std or mean, the step's reward/std or reward/mean; one named overlong, --overlong-penalty's."""
    (tmp_path / "rw.py").write_text("def correct(c, a, **kw):\n    return 0.5\n\nstd = overlong = correct\n")
    mine = f"{tmp_path}/rw.py:correct"
    for argv in (["--rewards", "correct", "--reward-fn", mine], ["--rewards", "correct,format,correct:2"],
                 ["--reward-fn", f"{tmp_path}/rw.py:std"], ["--algo", "dapo", "--reward-fn", f"{tmp_path}/rw.py:overlong"]):
        with pytest.raises(SystemExit, match=r"a reward is named twice, or mean or std \(metrics'\): \[.*\]: rename it"):
            grpo.build_rewards(grpo.parse_args(argv))
    assert [n for n, _, _ in grpo.build_rewards(grpo.parse_args(["--reward-fn", mine]))] == ["correct"]


def trl_reward_model_scores(path, prompts, completions):
    """TRL 1.16's own scoring with a reward model: GRPOTrainer._calculate_rewards (trl/trainer/grpo_trainer.py
    l. 1579) on a trainer made without __init__ (no hub, no accelerator), the classifier and its tokenizer set up
    as __init__ does (l. 558: from_pretrained(num_labels=1); l. 599-603: pad token, the config's pad_token_id)."""
    from types import SimpleNamespace
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import GRPOTrainer
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.config.get_text_config().pad_token_id = tok.pad_token_id
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    cpu = torch.device("cpu")
    trainer.reward_funcs, trainer.reward_processing_classes, trainer.reward_func_names = [model], [tok], ["rm"]
    trainer.accelerator = SimpleNamespace(device=cpu, is_main_process=True)
    trainer.args = SimpleNamespace(device=cpu, report_to=[])  # (Trainer._prepare_inputs, profiling_context)
    trainer.state, trainer.environments, trainer.is_deepspeed_enabled = SimpleNamespace(global_step=0), None, False
    trainer.chat_template_kwargs, trainer._log_completion_extra, trainer._log_metric = {}, None, None
    inputs = [{"prompt": p} for p in prompts]
    return trainer._calculate_rewards(inputs, prompts, completions, [[0]] * len(prompts))[:, 0]


@pytest.mark.parametrize("template", [True, False])
def test_a_reward_model_scores_as_trl_s_grpo_trainer(tiny_dir, tmp_path, template):
    """--reward-model's score of each completion a run logs is TRL's for the same chat (the system prompt, the
    prompt, the completion as the assistant's turn, rendered by the classifier's own template) to 1e-6, in
    micro-batches of 3 right-padded rows; a classifier with no chat template scores prompt + completion, as TRL
    does a prompt that is no chat. Weighed into the reward as --rewards says."""
    rm = tiny.make_tiny(str(tmp_path / "rm"), labels=1, seed=1, chat_template=tiny.CHAT_TEMPLATE if template else None)
    out = str(tmp_path / "out")
    main(["--model", tiny_dir, "--reward-model", rm, "--rewards", "correct, model:0.5", "--max-steps", "1",
          "--output-dir", out, "--log-samples", "2"] + TINY)
    samples = [json.loads(line) for line in open(os.path.join(out, "samples.jsonl"))]
    assert len(samples) == 8 and len({len(s["completion"]) for s in samples}) > 1
    prompts = [s["prompt"] for s in samples]
    completions = [s["completion"] for s in samples]
    if template:
        prompts = [[{"role": "system", "content": grpo.Args.system_prompt}, {"role": "user", "content": p}]
                   for p in prompts]
        completions = [[{"role": "assistant", "content": c}] for c in completions]
    want = trl_reward_model_scores(rm, prompts, completions)
    got = torch.tensor([s["rewards"]["model"] for s in samples])
    assert (got - want).abs().max() < 1e-6 and want.std() > 1e-3
    assert [s["reward"] for s in samples] == pytest.approx([s["rewards"]["correct"] + s["rewards"]["model"] / 2
                                                            for s in samples])


def test_a_reward_model_is_loaded_as_the_policy_and_frozen(tmp_path, monkeypatch):
    """On the policy's device, in its dtype (bf16 with --dtype bf16, fp32 on a CPU by default), NF4 weights with
    --load-in-4bit (bitsandbytes' Linear4bit, as QLoRA's policy); never trained: eval mode, no parameter that
    takes a gradient. Its scores are the fp32 classifier's up to the rounding."""
    from transformers import AutoModelForSequenceClassification
    rm = tiny.make_tiny(str(tmp_path / "rm"), labels=1)
    loaded, load = [], AutoModelForSequenceClassification.from_pretrained
    def spy(*args, **kw):
        loaded.append(load(*args, **kw))
        return loaded[-1]
    monkeypatch.setattr(AutoModelForSequenceClassification, "from_pretrained", spy)
    texts, records = ["\\boxed{3}", "I think it is 3, or 4."], [{"prompt": "1+2?", "answer": "3"}] * 2
    scores = {}
    for extra in ([], ["--dtype", "bf16"], ["--dtype", "bf16", "--load-in-4bit"]):
        fns = grpo.build_rewards(grpo.parse_args(["--reward-model", rm, "--rewards", "model"] + extra))
        scores[len(extra)] = grpo.score(text_rows(texts, records, [3, 9]), fns, grpo.parse_args([]))[1]["model"]
        model = loaded[-1]
        assert not model.training and not any(p.requires_grad for p in model.parameters())
        assert model.device.type == "cpu" and model.dtype == (torch.bfloat16 if extra else torch.float32)
        assert any(type(m).__name__ == "Linear4bit" for m in model.modules()) == ("--load-in-4bit" in extra)
    assert torch.allclose(scores[2], scores[0], atol=2e-2) and not torch.equal(scores[2], scores[0])
    assert torch.allclose(scores[3], scores[0], atol=0.1) and not torch.equal(scores[3], scores[2])


def test_a_bad_reward_model_is_refused_at_start_in_one_line(tiny_dir, tmp_path):
    """Not a classifier (a causal LM: TRL would put a random score head on it), more than one label, a tokenizer
    with more tokens than its embedding (another model's), a missing path, and `model` in --rewards without
    --reward-model or the reverse: each one line, before anything trains."""
    two = tiny.make_tiny(str(tmp_path / "two"), labels=2)
    other = tiny.make_tiny(str(tmp_path / "other"), labels=1)
    tiny.make_tokenizer(vocab_size=400).save_pretrained(other)
    path = "--reward-model '.*': "
    together = "--reward-model and the reward `model` go together: --reward-model ID --rewards model:0.5"
    for argv, says in [([tiny_dir], path + r"Qwen2ForCausalLM is not a sequence classifier \(its score head would"),
                       ([two], path + "a classifier of 2 labels: a reward model has one, the score"),
                       ([other], path + "its tokenizer has 400 tokens, its embedding 26[0-9]: another model's"),
                       ([str(tmp_path / "nowhere")], "--reward-model '.*nowhere': no such file or directory$"),
                       ([other, "--rewards", "correct"], together), (["", "--rewards", "model:2"], together)]:
        with pytest.raises(SystemExit, match=f"^grpo: error: {says}") as e:
            grpo.build_rewards(grpo.parse_args(["--rewards", "correct,model", "--reward-model"] + argv))
        assert "\n" not in str(e.value)



@pytest.mark.parametrize("expression, want", [
    ("(12 + 3) * -4 / 5", "-12.0"), ("7 // 2 + 7 % 3", "4"), ("2 ** -2", "0.25"), ("-(2 ** 10) - 1", "-1025"),
    ("10 ** 100", str(10 ** 100)), ("1.5e3", "1500.0")])
def test_the_calculator_by_hand(expression, want):
    assert R.calculator(expression) == want


@pytest.mark.parametrize("expression, says", [
    ("__import__('os')", "not arithmetic"), ("(1).real", "not arithmetic"), ("x + 1", "not arithmetic"),
    ("'a' * 3", "not arithmetic"), ("True + 1", "not arithmetic"), ("abs(-1)", "not arithmetic"),
    ("9**9**9", "an exponent over 100"), ("1" * 10000, "longer than 1000 characters"),
    ("10 ** 100 * 10", "within ±1e100"), ("2 ** 0.5 * 1e308", "within ±1e100"), ("(-8) ** 0.5", "within ±1e100"),
    ("1" * 101, "within ±1e100")])
def test_the_calculator_refuses_all_but_bounded_arithmetic(expression, says):
    """Names, calls, attributes, strings and booleans are never reached (the parse tree is walked, nothing is
    eval'd); an exponent over 100 is refused before it is computed, and every number is bounded."""
    with pytest.raises(ValueError, match=says):
        R.calculator(expression)


def test_tool_calls_are_parsed_in_qwen2_5_s_format():
    text = ('I will compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
            '<tool_call>{"name": "f", "arguments": {"x": [1, 2]}}</tool_call><tool_call>{"name": "f", "x": 1}'
            '</tool_call><tool_call>{"name": "f", "arguments": {"x": 1,}}</tool_call><tool_call>[1]</tool_call>'
            '<tool_call>{"name": "f"<|im_end|>')
    assert grpo.parse_tool_calls(text) == [
        {"name": "calculator", "arguments": {"expression": "6*7"}}, {"name": "f", "arguments": {"x": [1, 2]}},
        {"name": None, "arguments": '{"name": "f", "x": 1}'},  # no arguments, not JSON, not an object, not closed:
        {"name": None, "arguments": '{"name": "f", "arguments": {"x": 1,}}'},  # the text, which the model is told
        {"name": None, "arguments": "[1]"}, {"name": None, "arguments": '{"name": "f"<|im_end|>'}]
    assert grpo.parse_tool_calls("no call: <tool_response>\n42\n</tool_response>") == []

# ============================================================================= flags and data
PAPERS = {  # README's table, from the papers, written out here: never read from grpo.PRESETS
    "grpo": dict(scale="std", loss_agg="seq-mean-token-mean", eps_low=0.2, eps_high=0.2, beta=0.04),
    "drgrpo": dict(scale="none", loss_agg="seq-mean-token-sum-norm", eps_low=0.2, eps_high=0.2, beta=0.0),
    "dapo": dict(scale="std", loss_agg="token-mean", eps_low=0.2, eps_high=0.28, beta=0.0, dynamic_sampling=True,
                 overlong_penalty=True, rewards="correct_pm1"),
    "drgrpo_soft": dict(scale="none", loss_agg="seq-mean-token-sum", eps_low=0.2, eps_high=0.2, beta=0.0,
                        soft_reweight=True),
}
PLAIN = dict(dynamic_sampling=False, overlong_penalty=False, rewards="correct", soft_reweight=False, top_k_groups=0,
             mask_truncated=False, surrogate="clip", ratio="token", kl="k3", num_iterations=1, tis=0.0, dual_clip=0.0)


@pytest.mark.parametrize("algo", PAPERS)
def test_presets_are_the_papers_and_explicit_flags_win(algo):
    a = grpo.parse_args(["--algo", algo])
    want = {**PLAIN, **PAPERS[algo]}
    assert {k: getattr(a, k) for k in want} == want
    flipped = ["--no-dynamic-sampling" if a.dynamic_sampling else "--dynamic-sampling", "--eps-high", "0.3",
               "--loss-agg", "seq-mean-token-sum", "--beta", "0.01", "--scale", "none" if a.scale == "std" else "std"]
    b = grpo.parse_args(["--algo", algo] + flipped)
    assert (b.dynamic_sampling, b.eps_high, b.loss_agg, b.beta, b.scale, b.eps_low) == (
        not a.dynamic_sampling, 0.3, "seq-mean-token-sum", 0.01, {"std": "none", "none": "std"}[a.scale], 0.2)
    assert a.overlong_buffer == (256 // 5 if algo == "dapo" else 0)  # derived after parsing: L_cache = T // 5


@pytest.mark.parametrize("argv, says", [
    (["--load-in-4bit", "--lora-r", "0"], "--lora-r"),
    (["--split-grads"], "--teacher-pool"),
    (["--teacher-per-group", "2"], "--teacher-pool"),
    (["--num-generations", "1"], "--num-generations"),
    (["--top-k-groups", "9"], "--top-k-groups"),
    (["--adv-estimator", "gdpo", "--kl-in-reward", "0.1"], "gdpo normalises each reward function apart"),
    (["--adv-estimator", "gdpo", "--teacher-pool", "p.jsonl", "--teacher-per-group", "2"], "the pool's rewards"),
    (["--surrogate", "gmpo", "--ratio", "sequence"], "--surrogate gmpo and vespo take token ratios"),
    (["--output-dir", ""], "--output-dir must name a directory"),
    (["--eval-prompts", "5000"], "--eval-prompts: the built-in task has 2900"),
    (["--rewards", ""], "no reward"),
    (["--overlong-penalty", "--max-new-tokens", "64", "--overlong-buffer", "65"],
     "--overlong-buffer must be at most --max-new-tokens"),
])
def test_impossible_flags_fail_with_a_sentence(argv, says, tmp_path):
    with pytest.raises(SystemExit, match=says):  # (a pool file that is there)
        grpo.parse_args([write(tmp_path / x, []) if x == "p.jsonl" else x for x in argv])
    with pytest.raises(SystemExit, match="--resume continues the run, --overwrite deletes it: give one"):
        grpo.check_args(replace(grpo.parse_args([]), resume=True, overwrite=True))


@pytest.mark.parametrize("argv, says", [
    (["--tis-mode", "token_mask"], "--tis-mode does nothing without --tis: add it, or drop --tis-mode"),
    (["--tis-min", "0.5"], "--tis-min does nothing without --tis:"),
    (["--sapo-tau-pos", "2"], "--sapo-tau-pos does nothing without --surrogate sapo:"),
    (["--sapo-tau-neg", "2", "--surrogate", "cispo"], "--sapo-tau-neg does nothing without --surrogate sapo:"),
    (["--cov-ratio", "0.1"], "--cov-ratio does nothing without --surrogate clip_cov or --surrogate kl_cov:"),
    (["--cov-low", "0", "--surrogate", "kl_cov"], "--cov-low does nothing without --surrogate clip_cov:"),
    (["--cov-high", "9", "--surrogate", "kl_cov"], "--cov-high does nothing without --surrogate clip_cov:"),
    (["--cov-kl-coef", "1", "--surrogate", "clip_cov"], "--cov-kl-coef does nothing without --surrogate kl_cov:"),
    (["--dual-clip", "3", "--surrogate", "cispo"], "--dual-clip does nothing without --surrogate clip: add it, or "
                                                   "drop --dual-clip"),
    (["--scale", "none", "--adv-estimator", "rloo"], "--scale does nothing without --adv-estimator grpo:"),
    (["--algo", "drgrpo", "--scale", "std", "--adv-estimator", "gdpo"], "--scale does nothing without"),
    (["--algo", "drgrpo", "--kl", "k2"], "--kl does nothing without --beta: add it, or drop --kl"),
    (["--overlong-buffer", "8"], "--overlong-buffer does nothing without --overlong-penalty:"),
    (["--max-gen-rounds", "2"], "--max-gen-rounds does nothing without --dynamic-sampling:"),
    (["--surrogate", "clip_cov", "--cov-low", "5", "--cov-high", "1"], "--cov-low must be below --cov-high"),
    (["--surrogate", "clip_cov", "--cov-low", "2", "--cov-high", "2"], "--cov-low must be below --cov-high"),
])
def test_a_flag_typed_where_it_does_nothing_is_refused_naming_what_to_add(argv, says):
    """A flag the user typed where it acts on nothing (its needs) is refused in one line naming what it needs; a clip_cov
    range that holds nothing names what to change."""
    with pytest.raises(SystemExit, match=says):
        grpo.parse_args(argv)


def test_only_what_was_typed_is_refused_not_a_preset_s_or_a_saved_run_s_value(tmp_path):
    """A preset's value is not the user's: drgrpo's scale with rloo, grpo's beta under --kl, dapo's dynamic sampling
    under --max-gen-rounds stay valid; so do the variants' flags with what they act with. On --resume the saved
    run's flags are its defaults: a run saved with --scale beside rloo continues, --scale typed again is refused."""
    for argv in (["--algo", "drgrpo", "--adv-estimator", "rloo"], ["--kl", "k2"], ["--algo", "dapo", "--max-gen-rounds",
                 "2"], ["--algo", "dapo", "--adv-estimator", "gdpo"],
                 ["--surrogate", "sapo", "--sapo-tau-pos", "2"], ["--tis", "2", "--tis-mode", "token_mask", "--tis-min",
                 "0.5"], ["--surrogate", "kl_cov", "--cov-ratio", "0.1", "--cov-kl-coef", "1"],
                 ["--surrogate", "clip_cov", "--cov-low", "0", "--cov-high", "9", "--cov-ratio", "1"]):
        grpo.parse_args(argv)
    (tmp_path / "checkpoint").mkdir()
    saved = {**vars(grpo.Args()), "adv_estimator": "rloo", "scale": "none", "output_dir": str(tmp_path)}
    (tmp_path / "checkpoint" / "grpo_args.json").write_text(json.dumps(saved))
    a = grpo.parse_args(["--output-dir", str(tmp_path), "--resume", "--max-steps", "9"])
    assert (a.adv_estimator, a.scale, a.max_steps) == ("rloo", "none", 9)
    with pytest.raises(SystemExit, match="--scale does nothing without --adv-estimator grpo"):
        grpo.parse_args(["--output-dir", str(tmp_path), "--resume", "--scale", "none"])


def test_a_flag_s_partner_names_a_number_value_or_a_partner_whose_default_is_true(monkeypatch):
    """A flag's partner (flag's needs) is on when it is not at its default (not when it is truthy: --eps-high
    defaults to 0.2), and a value is matched as written (--num-iterations 2 is the int 2, the declared '2' a string)."""
    for name, needs in (("tis_mode", "num_iterations 2 3"), ("tis_min", "eps_high")):
        field = grpo.Args.__dataclass_fields__[name]
        monkeypatch.setattr(field, "metadata", {**field.metadata, "needs": needs})
    grpo.parse_args(["--tis-mode", "token_mask", "--num-iterations", "2"])
    grpo.parse_args(["--tis-min", "0.5", "--eps-high", "0.28"])
    with pytest.raises(SystemExit, match="--tis-mode does nothing without --num-iterations 2 or --num-iterations 3"):
        grpo.parse_args(["--tis-mode", "token_mask"])
    with pytest.raises(SystemExit, match="--tis-min does nothing without --eps-high: add it"):
        grpo.parse_args(["--tis-min", "0.5"])


def test_each_flag_s_declared_partner_is_a_flag_and_its_values_are_the_partner_s_choices():
    """A flag declares the flag it acts with beside itself (flag's needs): a name that is no flag, or a value the
    partner cannot take, would refuse the flag always (typed) or never. Each partner is a field, and each value one
    of its choices."""
    fields = grpo.Args.__dataclass_fields__
    declared = {f.name: f.metadata["needs"].split() for f in fields.values() if f.metadata["needs"]}
    assert {"tis_mode", "kl", "scale", "cov_ratio", "teacher_pool", "split_grads", "max_gen_rounds"} <= set(declared)
    for name, (on, *values) in declared.items():
        assert on in fields and set(values) <= set(fields[on].metadata["choices"]), (name, on, values)


@pytest.mark.parametrize("flag, value, says", [
    ("--num-generations", "0", r"--num-generations must be in \(0, inf\), not 0"),
    ("--max-grad-norm", "-1", r"must be in \[0, inf\), not -1"), ("--temperature", "0", "--temperature must be in"),
    ("--top-k", "-1", r"--top-k must be in \[0, inf\)"), ("--top-p", "1.5", r"--top-p must be in \(0, 1\], not 1.5"),
    ("--top-p", "0", r"--top-p must be in \(0, 1\]"), ("--lora-dropout", "1", r"--lora-dropout must be in \[0, 1\)"),
    ("--learning-rate", "0", "--learning-rate"), ("--lora-r", "-1", r"--lora-r must be in \[0, inf\)"),
    ("--max-steps", "0", r"--max-steps must be in \(0, inf\)"), ("--save-every", "-1", "--save-every"),
    ("--eval-every", "-1", "--eval-every"), ("--seed", "-1", "--seed"), ("--eval-samples", "-1", "--eval-samples must be"),
    ("--log-samples", "-1", "--log-samples must be"), ("--max-samples", "-1", "--max-samples must be"),
    ("--sapo-tau-neg", "0", r"--sapo-tau-neg must be in \(0, inf\)"), ("--beta", "-0.1", "--beta must be in"),
    ("--eps-high", "-0.1", "--eps-high"), ("--eval-prompts", "0", "--eval-prompts must be in"),
    ("--temperature", "nan", "not nan"), ("--learning-rate", "nan", r"--learning-rate must be in \(0, inf\), not nan"),
    ("--beta", "inf", r"--beta must be in \[0, inf\), not inf"), ("--max-grad-norm", "nan", "not nan"),
    ("--std-eps", "0", "--std-eps must be in"), ("--lora-alpha", "0", "--lora-alpha must be in"),
    ("--eps-low", "1", r"--eps-low must be in \[0, 1\)"), ("--warmup-steps", "-1", "--warmup-steps must be"),
    ("--micro-batch-size", "-1", r"--micro-batch-size must be in \(0, inf\), not -1"),
    ("--dual-clip", "1", r"--dual-clip must be in \(1, inf\), not 1.0"),
    ("--cov-ratio", "5", r"--cov-ratio must be in \(0, 1\], not 5.0"),
    ("--cov-ratio", "0", r"--cov-ratio must be in \(0, 1\], not 0.0"),  # verl refuses 0 too (it selects >= 1 token)
    ("--tis", "0.5", r"--tis must be in \[1, inf\), not 0.5"), ("--tis-min", "1", r"--tis-min must be in \[0, 1\)"),
    ("--top-entropy-quantile", "0", r"--top-entropy-quantile must be in \(0, 1\], not 0.0"),  # (0: one token trained)
])
def test_out_of_range_flags_fail_with_their_name(flag, value, says, tmp_path):
    pool = ["--teacher-pool", write(tmp_path / "p.jsonl", []), "--teacher-per-group", "2"]  # (a path that is there)
    extra = pool if flag == "--num-generations" else []
    with pytest.raises(SystemExit, match=says):
        grpo.parse_args([flag, value] + extra)


@pytest.mark.parametrize("flag, value, choices", [
    ("--surrogate", "ppo", "clip cispo sapo"), ("--kl", "k1", "k3 k3_ratio k2"), ("--ratio", "seq", "token sequence"),
    ("--algo", "ppo", "grpo drgrpo dapo drgrpo_soft"), ("--scale", "mad", "std none"), ("--dtype", "fp16", "auto bf16"),
    ("--loss-agg", "mean", "token-mean seq-mean-token-sum-norm"), ("--optim", "sgd", "adamw_torch paged_adamw_8bit")])
def test_a_flag_outside_its_choices_fails_with_them(flag, value, choices, capsys):
    with pytest.raises(SystemExit):
        grpo.parse_args([flag, value])
    err = capsys.readouterr().err
    assert f"argument {flag}: invalid choice: '{value}'" in err and all(c in err for c in choices.split())


def test_dry_run_prints_the_objective_then_the_flags(capsys, tmp_path):
    grpo.main(["--algo", "drgrpo", "--dry-run"])
    out = capsys.readouterr().out
    assert out.startswith("loss = Σ_i Σ_t ℓ_i,t / (n_seq·256),  Σ_t over m_i,t = 1 up to and including the first EOS\n"
                          "  ℓ_i,t = -min(r·A_i, clip(r, 1-0.2, 1+0.2)·A_i),  r = π_θ/π_old per token\n")
    assert "A_i = R_i - mean_g(R)\n" in out and "/ (std" not in out and "--algo 'drgrpo'" in out
    assert "groups trained: all; those of equal rewards (A = 0) skipped: ∇ℓ = 0 there" in out
    objective, flags = out.split("\n\n")  # the objective, a line a stage in the order they act; then the flags
    starts = [line.split()[0] for line in objective.splitlines()]
    assert starts == ["loss", "ℓ_i,t", "π_old", "A_i", "R_i", "o_1..8", "groups"] and flags.startswith("--algo")
    assert "B = 8 prompts q a step" in objective  # draw's words
    grpo.main(["--algo", "dapo", "--dry-run"])
    out = capsys.readouterr().out
    assert "loss = Σ_i Σ_t ℓ_i,t / Σ_i |o_i|," in out and "1+0.28" in out and "dynamic sampling (≤4 rounds)" in out
    assert "R_i = correct_pm1 + overlong(L_cache=51)" in out
    grpo.main(["--algo", "grpo", "--dry-run", "--surrogate", "sapo", "--ratio", "sequence", "--kl", "k3_ratio"])
    out = capsys.readouterr().out
    assert "-4/τ·σ(τ(r-1))·A_i (τ = 1 if A_i > 0 else 1.05) + 0.04·KL" in out and "r = s_i = exp(mean_t log" in out
    assert "+ 0.04·KL_k3_ratio(π_θ, π_ref)" in out and "those of equal rewards (A = 0) trained" in out
    grpo.main(["--algo", "grpo", "--dry-run", "--dual-clip", "3", "--beta", "0", "--num-iterations", "2"])
    out = capsys.readouterr().out
    assert "min(-min(r·A_i, clip(r, 1-0.2, 1+0.2)·A_i), 3·|A_i| if A_i < 0)" in out and "KL" not in out
    assert "π_old = π_θ before the first of 2 updates" in out
    grpo.main(["--algo", "drgrpo_soft", "--dry-run", "--tis", "2", "--top-k-groups", "4", "--mask-truncated"])
    out = capsys.readouterr().out
    assert "ℓ_i,t = (-min(r·A_i, clip(r, 1-0.2, 1+0.2)·A_i))·token_truncate(π_old/π_sampler, [0, 2])," in out
    assert "·  std_g / (max_g' std_g' + 1e-06)" in out and "groups trained: all, then the top-4 by std" in out
    assert "first EOS, 0 on a truncated completion" in out
    for estimator in ("reinforce_plus_plus_baseline", "gdpo"):  # whitened: an equal-reward group's A is not 0
        grpo.main(["--algo", "drgrpo", "--dry-run", "--adv-estimator", estimator])
        out = capsys.readouterr().out
        assert "(no A is 0)" in out and "those of equal rewards trained: their A is not 0\n" in out
    grpo.main(["--algo", "drgrpo", "--dry-run", "--kl-in-reward", "0.1"])  # equal rewards less unequal KLs
    assert "those of equal rewards trained: their A is not 0\n" in capsys.readouterr().out
    (tmp_path / "p.jsonl").touch()  # (a path that is not there is refused, as a real run refuses it)
    grpo.main(["--algo", "drgrpo", "--dry-run", "--teacher-pool", str(tmp_path / "p.jsonl"), "--teacher-per-group",
               "2", "--split-grads"])
    out = capsys.readouterr().out
    assert "first EOS; ∇ = g_s + g_t, the student's and the teacher's rows backpropagated apart\n" in out


@pytest.mark.parametrize("kw", [dict(), dict(beta=0.04), dict(adv_estimator="rloo"), dict(kl_in_reward=0.1),
                                dict(adv_estimator="reinforce_plus_plus_baseline"), dict(adv_estimator="gdpo")])
def test_dry_run_says_what_the_step_does_with_an_equal_reward_group(kw):
    """--dry-run's words on equal-reward groups come from the step's own decision: prepare skips the rows step_terms
    flags flat where probe finds no gradient at A = 0; a group of equal rewards (real step inputs) is flagged flat,
    and skipped, exactly where the words say so."""
    a = grpo.Args(num_generations=2, **kw)
    x = peer_inputs()
    _, row_adv, _, _, flat, *_ = step(a, [1.0, 1.0, 0.0, 1.0], x["mask"], old_logp=x["old_logp"],
                                      ref_logp=x["ref_logp"], per_fn=torch.tensor([[1.0, 0], [0, 2], [0, 0], [1, 0]]))
    _, skip, words = grpo.probe(a)
    said = grpo.describe(a).split("those of equal rewards ")[1].split("\n")[0]
    assert said == words["equal"] and bool(flat[0]) == (row_adv[:2] == 0).all()  # flat: A = 0 there
    assert said == {(True, True): "(A = 0) skipped: ∇ℓ = 0 there", (True, False): "(A = 0) trained"}.get(
        (bool(flat[0]), skip), "trained: their A is not 0")


def test_evaluation_flags_with_no_evaluation_set_are_refused(tmp_path):
    """--dataset with no --eval-dataset holds no held-out prompts: --eval-every, --eval-samples and --eval-prompts
    typed there do nothing, and are refused as any flag typed where it does nothing; with an evaluation set (an
    --eval-dataset, or the built-in task's held-out problems) they act, and 0 (evaluation off) says what is so."""
    data = write(tmp_path / "d.jsonl", ['{"prompt": "a", "answer": "1"}'])
    for flag, value in (("--eval-every", "5"), ("--eval-samples", "4"), ("--eval-prompts", "8")):
        with pytest.raises(SystemExit, match="^grpo: error: --eval-every, --eval-prompts and --eval-samples do nothing "
                                             "without --eval-dataset: add it$"):
            grpo.parse_args(["--dataset", data, flag, value])
        assert getattr(grpo.parse_args(["--dataset", data, "--eval-dataset", data, flag, value]),
                       flag[2:].replace("-", "_")) == int(value)
        grpo.parse_args([flag, value])  # the built-in task's held-out problems
    grpo.parse_args(["--dataset", data, "--eval-every", "0", "--eval-samples", "0"])


def test_a_local_path_that_is_not_there_is_refused_alike_by_a_run_and_by_dry_run(tiny_dir, tmp_path):
    """A tools file, dataset, reward file, teacher pool or model directory that is not there: one line, the same
    from --dry-run (which reads none of them) as from a run, before anything loads. A path is what names a local
    file (a .py or a dataset's suffix), starts with /, . or ~, or has a directory that is there; a mistyped one
    (models/tny for models/tiny) is named as not there, not read as a hub id and its naming rules."""
    (tmp_path / "models").mkdir()
    for flag, value in (("--tools", "tools.py"), ("--dataset", "train.jsonl"), ("--reward-fn", "rw.py:f"),
                        ("--model", "models/tny"), ("--model", "./tny"), ("--eval-dataset", "test.parquet"),
                        ("--teacher-pool", "pool.jsonl")):
        argv = ["--model", tiny_dir, "--output-dir", str(tmp_path / "out"), flag, value] + TINY
        argv += ["--teacher-per-group", "2"] if flag == "--teacher-pool" else []
        said = []
        for extra in ([], ["--dry-run"]):
            with pytest.raises(SystemExit) as e:
                main(argv + extra, cwd=tmp_path)
            said.append(str(e.value))
        assert said[0] == said[1] == f"grpo: error: {flag} '{value}': no such file or directory"
        assert not (tmp_path / "out").exists()
    for flag, value in (("--model", "Qwen/Qwen2.5-0.5B-Instruct"), ("--dataset", "openai/gsm8k:main"),
                        ("--tools", "calculator")):  # hub ids, and the built-in tool: no local path to look for
        assert getattr(grpo.parse_args([flag, value]), flag[2:]) == value


def test_answers_correct_cannot_read_are_counted_and_refused_at_start(tmp_path):
    """GSM8K-style records whose answers lost their '#### N': the reference is the whole worked solution, which
    `correct` compares with a completion's final answer, so no completion ever scores 1 (here not even the right
    number, boxed). Where a reward reads the answer, they are refused at start-up, with how many and one of
    them (several lines, or more than rewards.MAX_ANSWER characters: no final answer); with '#### N' they load,
    and a run whose rewards read no answer takes them as they are."""
    solution = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips in all."
    assert R.correct("\\boxed{72}", solution) == 0 and R.correct("\\boxed{72}", "72") == 1
    rows = [{"question": f"Q{i}?", "answer": solution} for i in range(3)] + [{"question": "Q?", "answer": "72"},
                                                                            {"question": "L?", "answer": "7" * 301}]
    data = write(tmp_path / "gsm.jsonl", [json.dumps(r) for r in rows])
    a = grpo.parse_args(["--dataset", data])
    with pytest.raises(SystemExit, match=r"^grpo: error: 4 answers `correct` cannot read, e.g. 'Natalia sold 48/2 = "
                                         r"<<48/2=24>>24 clips ': end each in '#### N'$"):
        grpo.load_data(a, grpo.build_rewards(a))
    held_out = grpo.parse_args(["--eval-dataset", data])  # evaluation grades by `correct` too
    with pytest.raises(SystemExit, match="^grpo: error: 4 answers `correct` cannot read"):
        grpo.load_data(held_out, grpo.build_rewards(held_out))
    fixed = write(tmp_path / "fixed.jsonl", [json.dumps({"question": "Q?", "answer": solution + "\n#### 72"})])
    assert grpo.load_data(grpo.parse_args(["--dataset", fixed]), grpo.build_rewards(a))[0][0]["answer"] == "72"
    shaped = grpo.parse_args(["--dataset", data, "--rewards", "format"])
    assert grpo.load_data(shaped, grpo.build_rewards(shaped))[0][0]["answer"] == solution


def test_dry_run_says_the_run_s_state_decides_an_equal_group_where_a_term_remembers(monkeypatch):
    """A term with memory across steps, a fork of step_terms (a running baseline: A = R - b once b has history, so
    an equal-reward group is trained then, and flagged flat only at the first step): probe's made-up numbers at
    one step would say such groups are skipped; --dry-run says the run's state decides (naming what it keeps),
    and what the first step does. A term whose state changes nothing of it (the KL's β) keeps its plain words."""
    plain, step_terms = grpo.probe(grpo.Args())[2]["equal"], grpo.step_terms
    def with_a_baseline(s, a, state):
        made, stats, words = step_terms(s, a, state)
        if "baseline" in state:  # history: A = R - b on every row, an equal group's too
            adv = (s["reward"] - state["baseline"])[:, None]
            made.update(adv=adv, row_adv=adv, flat=made["flat"] & False)
        state["baseline"] = 0.9 * state.get("baseline", s["reward"].mean()) + 0.1 * s["reward"].mean()
        return made, stats, words
    monkeypatch.setattr(grpo, "step_terms", with_a_baseline)
    said = f"as the run's state (baseline) has it; at the first step {plain}"
    assert plain == "(A = 0) skipped: ∇ℓ = 0 there" and grpo.probe(grpo.Args())[2]["equal"] == said
    assert f"those of equal rewards {said}\n" in grpo.describe(grpo.Args())
    monkeypatch.undo()
    for kw in (dict(kl_in_reward=0.1), dict(kl_in_reward=0.1, kl_target=0.01)):  # β: the run's state, too
        assert grpo.probe(grpo.Args(**kw))[2]["equal"] == "trained: their A is not 0"


def test_dry_run_reads_no_model_and_runs_no_reward(tmp_path, capsys):
    """--dry-run renders the objective from made-up numbers: a --model directory with no model in it and a reward
    file that would raise are not touched."""
    (tmp_path / "rw.py").write_text("raise RuntimeError('imported')\n")
    grpo.main(["--model", str(tmp_path), "--reward-fn", f"{tmp_path}/rw.py:f", "--dry-run"])
    assert "R_i = " + f"{tmp_path}/rw.py:f" in capsys.readouterr().out


# run-keeping, data, the model's parametrisation and the optimizer: flags that leave the objective as it is
NOT_THE_OBJECTIVE = {"algo", "model", "output_dir", "resume", "overwrite", "max_steps", "seed", "dry_run",
                     "teacher_pool", "reward_model",  # a file's path (`model` in --rewards shows the latter)
                     "save_every", "wandb_project", "log_samples", "dataset", "eval_dataset", "max_samples",
                     "eval_every", "eval_prompts", "eval_samples", "system_prompt", "compile_generate",
                     "skip_zero_variance", "lora_r", "lora_alpha", "lora_dropout", "load_in_4bit", "dtype",
                     "gradient_checkpointing", "micro_batch_size", "optim", "learning_rate", "warmup_steps",
                     "weight_decay", "max_grad_norm"}


def switched_on(f, v):
    """Values that turn the flag on, or choose otherwise: a bool flipped, every other choice, and for a number a
    value inside the bounds it declares, not its own."""
    if isinstance(v, bool):
        return [not v]
    if not isinstance(v, (int, float)):
        return [c for c in f.metadata["choices"] if c != v] or [v + "x"]
    low = float(f.metadata["bounds"][1:].split(",")[0])
    inside = [x for x in (v + 1, v / 2, low + 1, low + 0.5, 0.5) if x != v and grpo.within(x, f.metadata["bounds"])]
    return [type(v)(inside[0])]


def test_dry_run_shows_every_flag_that_changes_the_objective():
    """Each flag the objective depends on changes --dry-run's formula where it acts: a new flag is shown there,
    or listed above as leaving the objective as it is. A number flag is turned on inside its bounds, beside the flag it
    acts with (its needs) switched on."""
    every_term = grpo.Args(dynamic_sampling=True, overlong_penalty=True, overlong_buffer=10, soft_reweight=True,
                           beta=0.1, teacher_pool="pool.jsonl", teacher_per_group=2, split_grads=True,
                           top_k_groups=2, mask_truncated=True, tis=2.0, dual_clip=3.0, num_iterations=2,
                           reward_fn="rw.py:f", tools="calculator")
    bases = [every_term, grpo.Args()] + [replace(every_term, surrogate=s, dual_clip=0.0)
                                         for s in ("sapo", "clip_cov", "kl_cov")]
    def formula(a):
        return grpo.describe(a).split("\n\n")[0]
    unseen = []
    for f in grpo.dataclasses.fields(grpo.Args):
        if f.name in NOT_THE_OBJECTIVE:
            continue
        on, *values = (f.metadata["needs"] or "dry_run").split()  # the flag it acts with, on
        kind = type(getattr(grpo.Args, on))
        partner = [kind(v) for v in values] or switched_on(grpo.Args.__dataclass_fields__[on], getattr(every_term, on))
        with_partner = bases + [replace(every_term, **{on: partner[0]})]
        changed = [formula(replace(b, **{f.name: alt})) != formula(b)  # every choice renders
                   for b in with_partner for alt in switched_on(f, getattr(b, f.name))]
        if not any(changed):
            unseen.append(f.name)
    assert unseen == []
    assert NOT_THE_OBJECTIVE < set(grpo.Args.__dataclass_fields__)  # no stale names


def test_the_step_s_map_names_the_functions_in_the_order_main_runs_them():
    """The map where the loop begins names the step's stages in the order they run: each name a function of
    grpo.py, and main and train_step call the stages in that order (a renamed or reordered stage breaks it)."""
    source = inspect.getsource(grpo)
    block = source.split("- generate\n")[1].split("\ndef ")[0]  # the comment under the loop's first rule
    names = [n for n in re.findall(r"[a-z_]+", block) if callable(getattr(grpo, n, None))]
    stages = list(dict.fromkeys(names))
    assert stages[:10] == ["at_step", "rollout", "draw", "generate", "score", "select_groups", "train_step",
                           "prepare", "collate", "step_inputs"]
    order = lambda fn, names: [inspect.getsource(fn).index(n + "(") for n in names]  # noqa: E731
    assert order(grpo.main, ["at_step", "rollout", "train_step"]) == sorted(order(grpo.main, ["at_step", "rollout",
                                                                                              "train_step"]))
    assert order(grpo.rollout, ["draw", "generate", "score", "select_groups"]) == sorted(
        order(grpo.rollout, ["draw", "generate", "score", "select_groups"]))
    inside = ["collate", "probe", "step_inputs", "gather_step", "step_terms"]
    assert order(grpo.prepare, inside) == sorted(order(grpo.prepare, inside))


def test_each_fact_is_written_once():
    """A fact the step uses in several places has one home: G (group_size), "a group's rewards are all equal"
    (equal), pass@k's estimator (above the banner, where a term may use it), a record's chat prompt (prompt_text:
    sampling, evaluation and the start-up check of its length read it there)."""
    source = inspect.getsource(grpo)
    for fact in ("num_generations + a.teacher_per_group", ".max(-1).values == ", "math.comb(n - c, k)",
                 "apply_chat_template(messages", "a.system_prompt"):
        assert source.count(fact) == 1, fact
    assert source.index("def pass_at_k") < source.index("# ===") and "def group_size" in source


def test_paths_are_saved_absolute(tmp_path, tiny_dir):
    (tmp_path / "rw.py").write_text("def r(c, a):\n    return 1.0\n")
    (tmp_path / "gsm8k").mkdir()
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        a = grpo.parse_args(["--reward-fn", "rw.py:r", "--model", os.path.relpath(tiny_dir), "--dataset",
                             "gsm8k@test", "--eval-dataset", "gsm8k:main@test", "--reward-model", "gsm8k"])
    finally:
        os.chdir(here)
    assert a.reward_fn == f"{tmp_path}/rw.py:r" and a.model == tiny_dir and a.reward_model == f"{tmp_path}/gsm8k"
    assert (a.dataset, a.eval_dataset) == (f"{tmp_path}/gsm8k@test", f"{tmp_path}/gsm8k:main@test")  # DIR[:CONFIG][@SPLIT]
    assert grpo.parse_args(["--model", "Qwen/Qwen2.5-0.5B-Instruct"]).model == "Qwen/Qwen2.5-0.5B-Instruct"


def test_a_path_holding_an_at_or_a_colon_is_made_absolute_and_checked_on_resume(loaded, tiny_dir, tmp_path, capsys):
    """A path is the longest part of PATH[:...][@...] that exists. data@v2.jsonl was once read as the path 'data':
    not made absolute, and a changed file went unnoted on --resume. --output-dir is absolute too: a reward that
    changes the working directory moves nothing."""
    (tmp_path / "r:1").mkdir()
    (tmp_path / "r:1" / "rw.py").write_text("def f(c, a):\n    return 1.0\n")
    data = write(tmp_path / "data@v2.jsonl", ['{"prompt": "a", "answer": "1"}'])
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        a = grpo.parse_args(["--dataset", "data@v2.jsonl", "--reward-fn", "r:1/rw.py:f", "--output-dir", "out"])
    finally:
        os.chdir(here)
    assert (a.dataset, a.reward_fn, a.output_dir) == (data, f"{tmp_path}/r:1/rw.py:f", f"{tmp_path}/out")
    _, model, tok = loaded
    grpo.save(model, tok, replace(loaded[0], dataset=data, output_dir=a.output_dir),
              {"step": 1, "prompts_drawn": 0, "rng": [], "optimizer": {}})
    write(tmp_path / "data@v2.jsonl", ['{"prompt": "a", "answer": "2"}'])
    capsys.readouterr()
    grpo.parse_args(["--output-dir", a.output_dir, "--resume", "--max-steps", "9"])
    assert capsys.readouterr().err == "grpo: note: the --dataset file has changed since the run was saved\n"
    (tmp_path / "away").mkdir()
    (tmp_path / "r:1" / "rw.py").write_text(f"import os\ndef f(c, a, **kw):\n    os.chdir({str(tmp_path / 'away')!r})"
                                            "\n    return 1.0\n")
    main(["--model", tiny_dir, "--output-dir", "run", "--reward-fn", "r:1/rw.py:f", "--max-steps", "1",
          "--eval-every", "0"] + TINY, cwd=tmp_path)
    assert capsys.readouterr().out.splitlines()[-1] == f"grpo: step 1 saved in {tmp_path}/run/checkpoint; " \
                                                       f"metrics in {tmp_path}/run/metrics.jsonl"
    assert (tmp_path / "run" / "checkpoint").is_dir() and not (tmp_path / "away" / "run").exists()


@pytest.mark.parametrize("lines, says", [
    (['{"prompt": "a", "answer": "1"}', '{"prompt": "b", "answer": '], "bad.jsonl:2: not a JSON object .Expecting value"),
    (['{"prompt": "a", "answer": "1"}', '{"prompt": "b"}'], "bad.jsonl:2: each line needs a prompt .* and an answer"),
    (["", "  "], "bad.jsonl: no examples"),
    (['[{"prompt": "a", "answer": "1"}]'], "bad.jsonl:1: not a JSON object .*; JSONL is one JSON object a line"),
    (["[", '{"prompt": "a", "answer": "1"}', "]"], "bad.jsonl:1: not a JSON object .*JSONL is one JSON object a line"),
    (['{"prompt": ["a"], "answer": "1"}'], "bad.jsonl:1: each line needs a prompt"),
    (['{"prompt": "a", "answer": "1"}', '{"prompt": "x", "answer": null}'], "bad.jsonl:2: each line needs"),
    (['{"prompt": "x", "answer": " "}'], "bad.jsonl:1: each line needs a prompt .* neither empty"),
    (['{"question": "x", "answer": ""}'], "bad.jsonl:1: each line needs a prompt .or GSM8K's question."),
    (['{"prompt": "a", "answer": "1"}', '{"prompt": "b", "answer": ["1", "2"]}'], "bad.jsonl:2: .* .a string or a finite number"),
    (['{"prompt": "a", "answer": {"n": 1}}'], "bad.jsonl:1: each line needs .* an answer .a string or a finite number"),
    (['{"prompt": "a", "answer": true}'], "bad.jsonl:1: each line needs .* an answer .a string or a finite number"),
    (['{"prompt": "a", "answer": "1", "temperature": 0.7}', '{"prompt": "b", "answer": "1", "temperature": "hot"}'],
     "bad.jsonl:2: each line needs .* a temperature, if any, above 0"),  # (its prompt's: refused before any run)
    (['{"prompt": "a", "answer": "1", "temperature": 0}'], "bad.jsonl:1: each line needs .* a temperature, if any"),
    (['{"question": "a", "answer": "2+2=4\\n####"}'], "bad.jsonl:1: each line needs .* GSM8K's: '... #### N'"),
    (['{"prompt": "a", "answer": "1"}', '{"prompt": "x\\ud800", "answer": "1"}'], "bad.jsonl:2: '\\\\ud800' is half a "
                                                                            "surrogate pair, not text"),
    (['{"prompt": "a", "answer": "1"}', '{"prompt": "caf\\u00e9", "answer": "1"}'], None),
])
def test_bad_data_names_file_and_line(tmp_path, lines, says):
    path = write(tmp_path / "bad.jsonl", lines)
    if says is None:  # not UTF-8: latin-1 bytes
        (tmp_path / "bad.jsonl").write_bytes('{"prompt": "a", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "1"}\n'
                                             .encode("latin-1"))
        says = "bad.jsonl:2: not a JSON object"
    with pytest.raises(SystemExit, match=says):
        grpo.main(["--dataset", path, "--model", "no-such/model", "--output-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_a_missing_file_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="nope.jsonl: No such file or directory"):
        grpo.load_examples(str(tmp_path / "nope.jsonl"), "train", True)


def test_an_answer_given_as_a_json_number_is_graded_as_written(tmp_path):
    """Python prints 0.00005 and 1e16 as '5e-05' and '1e+16', which no completion's number equals."""
    path = write(tmp_path / "n.jsonl", ['{"prompt": "a", "answer": 0.00005}', '{"prompt": "b", "answer": 1e16}',
                                        '{"prompt": "c", "answer": 2.50}', '{"prompt": "d", "answer": 7}'])
    examples = grpo.load_examples(path, "train", True)
    assert [ex["answer"] for ex in examples] == ["0.00005", "10000000000000000", "2.5", "7"]
    assert R.is_correct("The answer is 0.00005.", examples[0]["answer"])
    assert R.is_correct("\\boxed{10,000,000,000,000,000}", examples[1]["answer"])


def test_a_number_answer_is_the_shortest_text_that_reads_back_in_its_own_precision(tmp_path, monkeypatch, loaded):
    """A float32 column (pandas, pyarrow) holds 0.1 as 0.100000001490116...: read as float64 it would be the
    reference '0.10000000149011612', which no completion writes. Its answer is float32's shortest text, '0.1', as
    JSON's 0.1 is float64's; a float64 column keeps float64's. An integer cell (CSV, int32) is its digits, a decimal
    column its digits at its scale; a bool is no answer. Graded through the real loading code, in training (the
    reward) and in evaluation."""
    pd = pytest.importorskip("pandas")
    datasets = pytest.importorskip("datasets")
    np, pa, pq = pytest.importorskip("numpy"), pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    written = ["0.00005", "0.1", "2.5", "10000000000000000", "3.0", "0.3"]  # float32(1e16) is 10000000272564224
    f32 = pd.DataFrame({"prompt": [f"q{i}" for i in range(6)], "answer": np.array(written, dtype=np.float32)})
    f32.to_parquet(tmp_path / "f32.parquet")
    f32.to_csv(tmp_path / "f32.csv", index=False)  # pandas writes float32's shortest text; read back as float64
    datasets.Dataset.from_pandas(f32).to_parquet(str(tmp_path / "ds.parquet"))
    for name in ("f32.parquet", "f32.csv", "ds.parquet"):
        examples = grpo.load_examples(str(tmp_path / name), "train", True)
        assert [ex["answer"] for ex in examples] == written, name
    wide = pd.DataFrame({"prompt": ["a", "b"], "answer": [0.1, float(np.float32(0.1))]})  # float64: its own text
    wide.to_parquet(tmp_path / "f64.parquet")
    assert [ex["answer"] for ex in grpo.load_examples(str(tmp_path / "f64.parquet"), "train", True)] == \
        ["0.1", "0.10000000149011612"]
    pd.DataFrame({"prompt": ["a", "b"], "answer": [7, -12]}).to_csv(tmp_path / "int.csv", index=False)
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": pa.array([7, 40000], pa.int32())}), tmp_path / "i.parquet")
    pq.write_table(pa.table({"prompt": ["a"], "answer": pa.array([decimal.Decimal("12.50")], pa.decimal128(5, 2))}),
                   tmp_path / "dec.parquet")
    got = [[ex["answer"] for ex in grpo.load_examples(str(tmp_path / f), "train", True)]
           for f in ("int.csv", "i.parquet", "dec.parquet")]
    assert got == [["7", "-12"], ["7", "40000"], ["12.50"]]
    pd.DataFrame({"prompt": ["a"], "answer": [True]}).to_parquet(tmp_path / "bool.parquet")
    with pytest.raises(SystemExit, match="bool.parquet@train:1: each line needs .* an answer .a string or a finite"):
        grpo.load_examples(str(tmp_path / "bool.parquet"), "train", True)
    _, evals = grpo.load_data(grpo.parse_args(["--dataset", str(tmp_path / "f32.parquet"), "--eval-dataset",
                                               str(tmp_path / "f32.parquet")]))
    boxed = [f"so \\boxed{{{x}}}" for x in ("0.00005", "0.1", "2.5", "10,000,000,000,000,000", "3", ".3")]
    fns = grpo.build_rewards(grpo.parse_args(["--rewards", "correct"]))
    assert grpo.score(text_rows(boxed, evals, [5] * 6), fns, grpo.parse_args([]))[0].tolist() == [1.0] * 6
    a, model, tok = loaded

    def fake_generate(model, tok, rows, a, greedy=False, sampler=None, tools=None):  # each prompt's boxed answer
        for r in rows:
            ids = tok(boxed[int(r["record"]["prompt"][1:])], add_special_tokens=False).input_ids  # prompt q3: 3
            r["completion"] = torch.tensor(ids)
            r["text"] = tok.decode(r["completion"], skip_special_tokens=True)
        return rows
    monkeypatch.setattr(grpo, "generate", fake_generate)
    assert grpo.evaluate(model, tok, evals, replace(a, eval_samples=0), 0, 1)["eval/accuracy"] == 1.0


@pytest.mark.parametrize("lines", [['{"prompt": "a", "answer": NaN}'], ['{"prompt": "a", "answer": Infinity}'],
                                   ['{"prompt": "a", "answer": -Infinity}'], ['{"prompt": "a", "answer": 1e400}'],
                                   "prompt,answer\na,1e400\n", "prompt,answer\na,-inf\n"])
def test_an_answer_no_completion_can_equal_is_refused_at_load(tmp_path, monkeypatch, lines):
    """NaN, ±Infinity (JSON's 1e400 too, and a CSV's) are no answer a reward can grade: refused with the line."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    path = write(tmp_path / "d.jsonl", lines) if isinstance(lines, list) else str(tmp_path / "d.csv")
    if isinstance(lines, str):
        (tmp_path / "d.csv").write_text(lines)
    with pytest.raises(SystemExit, match=r"d\.(jsonl|csv@train):1: each line needs .* an answer .a string or a finite"):
        grpo.load_examples(path, "train", False)


def test_gsm8k_format_jsonl(tmp_path):
    path = write(tmp_path / "g.jsonl", ['{"question": "2+2?", "answer": "2+2=<<2+2=4>>4\\n#### 4"}'])
    assert grpo.load_examples(path, "train", True) == [{"question": "2+2?", "prompt": "2+2?", "answer": "4"}]


GSM8K = [{"question": f"Tom has {i} pens and buys {i + 2}. How many now?", "answer": f"{i}+{i + 2}=<<{i}+{i + 2}="
          f"{2 * i + 2}>>{2 * i + 2}\n#### {2 * i + 2}", "level": i % 2} for i in range(5)]


def test_a_dataset_that_is_not_a_jsonl_file_loads_through_datasets(tmp_path, monkeypatch):
    """--dataset openai/gsm8k goes to datasets.load_dataset (NAME[:CONFIG][@SPLIT]); a local directory of parquet
    files is read as a hub dataset is, which is how this is tested: nothing is downloaded. Its records go through
    the JSONL reader's checks: the same examples as the same records in a JSONL file."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    d = tmp_path / "gsm8k"
    d.mkdir()
    datasets.Dataset.from_list(GSM8K[:3]).to_parquet(str(d / "train.parquet"))
    datasets.Dataset.from_list(GSM8K[3:]).to_parquet(str(d / "test.parquet"))
    as_jsonl = grpo.load_examples(write(tmp_path / "g.jsonl", [json.dumps(r) for r in GSM8K]), "train", True)
    assert [ex["answer"] for ex in as_jsonl] == ["2", "4", "6", "8", "10"]
    train, evals = grpo.load_data(grpo.parse_args(["--dataset", str(d), "--eval-dataset", str(d)]))
    assert (train, evals) == (as_jsonl[:3], as_jsonl[3:])  # the splits: train, and test for evaluation
    _, evals = grpo.load_data(grpo.parse_args(["--dataset", str(d), "--eval-dataset", f"{d}@train"]))
    assert evals == as_jsonl[:3]  # a split named
    with pytest.raises(SystemExit, match=f"{d}@valid: Unknown split .valid."):
        grpo.load_data(grpo.parse_args(["--dataset", f"{d}@valid"]))
    with pytest.raises(SystemExit, match=f"{d}:other@train: BuilderConfig 'other' not found"):
        grpo.load_data(grpo.parse_args(["--dataset", f"{d}:other"]))
    datasets.Dataset.from_list([GSM8K[0], {**GSM8K[1], "answer": "4 ####"}]).to_parquet(str(d / "train.parquet"))
    with pytest.raises(SystemExit, match=f"{d}@train:2: each line needs a prompt"):
        grpo.load_data(grpo.parse_args(["--dataset", str(d)]), [("correct", R.correct, 1.0)])
    with pytest.raises(SystemExit, match=f"{tmp_path}/empty@train: .*"):
        (tmp_path / "empty").mkdir()
        grpo.load_data(grpo.parse_args(["--dataset", str(tmp_path / "empty")]))


def test_a_local_parquet_csv_or_json_file_loads_through_datasets(tmp_path, monkeypatch):
    """Not JSONL, which a local file was taken to be: the records of the same examples."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    want = grpo.load_examples(write(tmp_path / "g.jsonl", [json.dumps(r) for r in GSM8K]), "train", True)
    rows = datasets.Dataset.from_list(GSM8K)
    for name, to in (("g.parquet", rows.to_parquet), ("g.csv", rows.to_csv), ("g.json", rows.to_json)):
        to(str(tmp_path / name))
        assert grpo.load_data(grpo.parse_args(["--dataset", str(tmp_path / name)]))[0] == want, name
        _, evals = grpo.load_data(grpo.parse_args(["--dataset", str(tmp_path / name), "--eval-dataset",
                                                   str(tmp_path / name)]))
        assert evals == want  # the file's rows, whatever the split's name
    (tmp_path / "bad.json").write_text('{"question": "2+2?", "answer": \n')
    with pytest.raises(SystemExit, match=f"^grpo: error: {tmp_path}/bad.json@train: "):
        grpo.load_data(grpo.parse_args(["--dataset", str(tmp_path / "bad.json")]))


@pytest.mark.parametrize("name, text", [("e.csv", ""), ("e.json", ""), ("e.parquet", ""), ("e.jsonl", ""),
                                        ("head.csv", "prompt,answer\n"), ("list.json", "[]\n"), ("blank.jsonl", "\n\n")])
def test_a_local_file_with_no_rows_says_so_in_one_line(tmp_path, monkeypatch, name, text):
    """Empty, a CSV header alone, a JSON []: grpo's own line, as an empty JSONL file gets, not `datasets`' words."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    (tmp_path / name).write_text(text)
    with pytest.raises(SystemExit, match=f"^grpo: error: {tmp_path / name}: no examples$"):
        grpo.load_data(grpo.parse_args(["--dataset", str(tmp_path / name)]))


def test_an_upper_case_extension_loads_and_a_file_has_one_split(tmp_path, monkeypatch):
    """DATA.PARQUET is parquet, not JSONL; a local file is the one split `datasets` makes of it, 'train' (the
    rows of --dataset and of --eval-dataset alike): FILE@train is that, FILE@test (a JSONL file too) is refused in
    one line, never looked for on the hub."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    want = grpo.load_examples(write(tmp_path / "g.jsonl", [json.dumps(r) for r in GSM8K]), "train", True)
    datasets.Dataset.from_list(GSM8K).to_parquet(str(tmp_path / "G.PARQUET"))
    assert grpo.load_data(grpo.parse_args(["--dataset", str(tmp_path / "G.PARQUET")]))[0] == want
    assert grpo.load_data(grpo.parse_args(["--dataset", f"{tmp_path}/g.jsonl@train"]))[0] == want
    for name in ("g.jsonl", "G.PARQUET"):
        with pytest.raises(SystemExit, match=f"^grpo: error: {tmp_path / name}@test: Unknown split \"test\". Should "
                                             r"be one of \['train'\]\.$"):
            grpo.load_data(grpo.parse_args(["--dataset", f"{tmp_path / name}@test"]))


def test_a_dataset_without_datasets_installed_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(SystemExit, match=r"^grpo: error: openai/gsm8k is not a JSONL file: a dataset needs "
                                         r"`pip install datasets` \(.*datasets.*\)$"):
        grpo.load_data(grpo.parse_args(["--dataset", "openai/gsm8k"]))


def test_eval_dataset_and_max_samples(tmp_path):
    evals = write(tmp_path / "e.jsonl", ['{"prompt": "held out?", "answer": "1"}'])
    train, ev = grpo.load_data(grpo.parse_args(["--eval-dataset", evals]))
    assert len(train) == 20000 and ev == [{"prompt": "held out?", "answer": "1"}]
    train, _ = grpo.load_data(grpo.parse_args(["--max-samples", "300"]))
    assert train == grpo.load_data(grpo.parse_args([]))[0][:300]


def pool_lines(prompts, n=2, reward="1.0"):
    return [json.dumps({"prompt": p, "completion": f"\\boxed{{{i}}}", "reward": float(reward) if reward != "bad" else
                        "abc"}) for p in prompts for i in range(n)]


def long_lines(prompts):
    """Teacher completions of 11, 12 and 20 bytes: tiny's tokenizer has one token a byte, so 12, 13 and 21 tokens
    with the EOS; T = 12 holds the first exactly. An untrained prompt's long completion does not count."""
    return [json.dumps({"prompt": p, "completion": c * n, "reward": 1.0})
            for p in prompts for c, n in (("x", 11), ("y", 12), ("z", 20))] + \
        [json.dumps({"prompt": "untrained", "completion": "w" * 40, "reward": 1.0})]


@pytest.mark.parametrize("case, says", [
    ("missing", "pool.jsonl:1: each line needs a prompt, a completion and a reward, a number finite in float32"),
    ("nan", "pool.jsonl:1: each line needs .* finite in float32"),
    ("bad", "pool.jsonl:1: each line needs .* finite in float32"),
    ("1e308", "pool.jsonl:1: each line needs .* finite in float32"),  # finite in Python: inf in the step
    ("10**400", "pool.jsonl:1: each line needs .* finite in float32"),  # an int that no float holds
    ("long", "^grpo: error: --teacher-pool: 6 completions are longer than --max-new-tokens 12 tokens with their "
             "EOS .the longest: 21.: raise --max-new-tokens, or drop them$"),
    ("absent", "1 training prompts have fewer than --teacher-per-group 3 completions in the pool, e.g. 'p3'"),
    ("short", "3 training prompts have fewer than --teacher-per-group 3 .* e.g. 'p1'.* lower --teacher-per-group"),
    ("prompt list", "pool.jsonl:1: each line needs a prompt"),
    ("completion null", "pool.jsonl:1: each line needs a prompt, a completion"),
])
def test_bad_pool_is_a_clear_error_before_training(tiny_dir, tmp_path, case, says):
    """Teacher completions are tokenized as the policy would emit them (text + EOS): one over T would be cut and
    keep the reward of its whole text, so the pool is refused, saying how many and the longest."""
    prompts = ["p1", "p2", "p3"]
    data = write(tmp_path / "data.jsonl", [json.dumps({"prompt": p, "answer": "1"}) for p in prompts])
    lines = {"missing": ['{"prompt": "p1", "completion": "x"}'], "nan": pool_lines(prompts, reward="nan"),
             "bad": pool_lines(prompts, reward="bad"), "absent": pool_lines(prompts[:2], n=3),
             "short": pool_lines(prompts, n=2), "1e308": pool_lines(prompts, reward="1e308"),
             "10**400": ['{"prompt": "p1", "completion": "x", "reward": 1' + "0" * 400 + '}'], "long": long_lines(prompts),
             "prompt list": ['{"prompt": ["p1"], "completion": "x", "reward": 1}'],
             "completion null": ['{"prompt": "p1", "completion": null, "reward": 1}']}[case]
    pool = write(tmp_path / "pool.jsonl", lines)
    with pytest.raises(SystemExit, match=says):
        main(["--dataset", data, "--teacher-pool", pool, "--teacher-per-group", "3", "--model", tiny_dir,
              "--max-new-tokens", "12", "--output-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_a_prompt_with_no_room_for_t_tokens_is_refused_at_start_with_its_file_and_line(tiny_dir, tmp_path):
    """Prompt tokens + T must fit the model's context (config.max_position_embeddings, 4096 for the tiny model):
    a longer prompt, in --dataset or --eval-dataset, is refused before anything is written, naming its file and line,
    not met hours in as an allocation error inside generate. The tiny tokenizer is one token a byte."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    template = len(tok(grpo.chat_prompt(tok, "", grpo.Args.system_prompt), add_special_tokens=False).input_ids)
    long = json.dumps({"prompt": "x" * 4090, "answer": "1"})
    short = '{"prompt": "q", "answer": "1"}'
    data = write(tmp_path / "d.jsonl", [short, "", long])
    evals = write(tmp_path / "e.jsonl", [short, long])
    argv = ["--model", tiny_dir, "--output-dir", str(tmp_path / "out")] + NO_EVAL
    for extra, where in ((["--dataset", data], f"{data}:3"), (["--eval-dataset", evals], f"{evals}:2")):
        with pytest.raises(SystemExit, match=f"^grpo: error: {where}: a prompt of {template + 4090} tokens, with "
                                             f"--max-new-tokens 12, is over the model's context .4096.: shorten it"):
            main(argv + extra)
        assert not (tmp_path / "out").exists()


def test_only_the_prompts_a_byte_count_leaves_in_doubt_are_tokenized_at_start(loaded, tmp_path, monkeypatch):
    """longest_prompt: at the context's edge, by hand (prompt tokens + T = the context fits, one more does not); the
    built-in task's 20,000 prompts are not tokenized at all (none is near 4096 bytes); and with every (the compiled
    sampler's one shape) the longest of all, as tokenizing each gives."""
    a, model, tok = loaded
    template = len(tok(grpo.chat_prompt(tok, "", a.system_prompt), add_special_tokens=False).input_ids)
    monkeypatch.setattr(model.config, "max_position_embeddings", template + 50 + a.max_new_tokens)
    data = write(tmp_path / "d.jsonl", [json.dumps({"prompt": "x" * n, "answer": "1"}) for n in (3, 50, 49, 51)])
    examples = grpo.load_examples(data, "train", False)
    assert grpo.longest_prompt(model, tok, a, examples[:3], [], every=False) == template + 50
    assert grpo.longest_prompt(model, tok, a, examples[:3], [], every=True) == template + 50
    with pytest.raises(SystemExit, match=f"^grpo: error: {data}:4: a prompt of {template + 51} tokens, with "
                                         f"--max-new-tokens {a.max_new_tokens}, is over the model's context "
                                         f".{template + 50 + a.max_new_tokens}.: shorten it"):
        grpo.longest_prompt(model, tok, replace(a, dataset=data), examples, [], every=False)
    monkeypatch.undo()
    train, evals = grpo.load_data(replace(a, dataset=""))
    assert len(train) == 20000 and grpo.longest_prompt(model, tok, a, train, evals, every=False) == 0
    texts = [grpo.chat_prompt(tok, ex["prompt"], a.system_prompt) for ex in train[:300] + evals]
    longest = max(len(tok(t, add_special_tokens=False).input_ids) for t in texts)
    assert grpo.longest_prompt(model, tok, a, train[:300], evals, every=True) == longest


def test_a_tokenizer_learnt_from_a_corpus_merges_words_and_splits_numbers_into_digits():
    corpus = ["Ava has 23 apples and gets 45 more."] * 20
    tok = tiny.make_tokenizer(vocab_size=300, corpus=corpus)
    assert tok.convert_ids_to_tokens(tok("Ava has 123 apples").input_ids) == ["Ava", "Ġhas", "Ġ", "1", "2", "3",
                                                                              "Ġapples"]  # as Qwen2 splits them
    text = "Ben gives away 7 pens; é€ 10."  # never in the corpus: bytes, and back
    assert tok.decode(tok(text).input_ids) == text
    assert tok.convert_ids_to_tokens(range(4)) == tiny.SPECIALS and len(tok) <= 300


# ============================================================================= tier 2: the tiny model, in-process
@pytest.mark.parametrize("dtype, atol", [("fp32", 1e-4), ("bf16", 1e-2)])
def test_train_logps_match_the_sampler(loaded, loaded_bf16, dtype, atol):
    """The training forward (left padding, position ids, hidden states of the completion only) gives the
    log-probs the sampler used: otherwise ratio = 1 would be a lie. In bf16 the two may differ by
    rounding alone: the sampler's cached decoding and the training forward can add the same bf16
    numbers in another order, and one bf16 rounding is worth at most 2^-9 of a value. The logits here
    are below 1.5 in size, so 0.01 nat allows several roundings (measured on this CPU: 5e-7), while a
    shifted position or a padding bug moves log-probs by tenths of a nat or more."""
    a, model, tok = loaded if dtype == "fp32" else loaded_bf16
    from transformers import GenerationConfig
    texts = [grpo.chat_prompt(tok, q, "") for q in ("1+1?", "a much longer question, 12 + 30?")]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(0)
    out = model.generate(input_ids=enc.input_ids, attention_mask=enc.attention_mask, generation_config=GenerationConfig(
        max_new_tokens=8, do_sample=True, top_k=0, pad_token_id=tok.pad_token_id, eos_token_id=model.generation_config.eos_token_id),
        output_logits=True, return_dict_in_generate=True)
    comp = out.sequences[:, enc.input_ids.shape[1]:]
    sampler = torch.stack(out.logits, 1).log_softmax(-1).gather(-1, comp[..., None])[..., 0]
    attn = torch.cat([enc.attention_mask, torch.ones_like(comp)], 1)
    logp, entropy = grpo.token_logps(model, out.sequences, attn, comp.shape[1])
    mask = grpo.completion_mask(comp, model.generation_config.eos_token_id)
    assert (logp[mask] - sampler[mask].float()).abs().max() <= atol
    assert (entropy > 0).all() and (entropy <= math.log(len(tok)) + 1e-4).all()


def test_sampling_ignores_the_model_s_own_generation_defaults(tmp_path):
    """generate() fills unset fields from the checkpoint's generation_config.json. One that suppresses
    every token but one (and a repetition penalty) must not reach the sampler: samples still differ."""
    path = tiny.make_tiny(str(tmp_path / "m"))
    from transformers import GenerationConfig
    GenerationConfig(do_sample=True, suppress_tokens=[i for i in range(260) if i != 20], repetition_penalty=3.0,
                     eos_token_id=2).save_pretrained(path)
    a = grpo.parse_args(["--model", path, "--max-new-tokens", "8", "--system-prompt", ""])
    model, tok, _ = grpo.load_model(a, torch.device("cpu"))
    rows = grpo.generate(model, tok, [{"record": {"prompt": "1+1?", "answer": ""}} for _ in range(8)], a)
    assert len({tuple(r["completion"].tolist()) for r in rows}) > 1
    assert model.generation_config.eos_token_id == [tok.eos_token_id]


def test_every_eos_id_of_the_model_ends_a_completion(eos_dir):
    """A chat model may end on several tokens (Qwen2.5's generation config lists <|im_end|> and <|endoftext|>, its
    tokenizer names one): the sampler stops at any of them, and a completion is cut after the first, not truncated,
    its log-probs as long. One that ran on past such a token would be marked truncated and trained past its end."""
    a = grpo.parse_args(["--model", eos_dir, "--max-new-tokens", "12"])
    model, tok, _ = grpo.load_model(a, torch.device("cpu"))
    from transformers import GenerationConfig
    eos = GenerationConfig.from_pretrained(eos_dir).eos_token_id
    assert model.generation_config.eos_token_id == sorted(eos) and len(eos) == 22
    torch.manual_seed(0)
    rows = grpo.generate(model, tok, [{"record": {"prompt": t, "answer": ""}} for t in TEXTS for _ in range(8)], a)
    for r in rows:
        c, cut, lp = r["completion"], r["truncated"], r["logp"]
        ends = [i for i, t in enumerate(c.tolist()) if t in eos]
        assert ends == ([] if cut else [len(c) - 1]) and (len(c) == 12 or not cut) and len(lp) == len(c)
    ended_by = {r["completion"][-1].item() for r in rows if not r["truncated"]}
    assert len(ended_by - {tok.eos_token_id}) >= 2  # the model's other EOS ids end some


def test_pi_old_and_the_reference_are_the_policy_at_its_temperature_over_several_updates(tiny_dir):
    """With --num-iterations 2 the step computes π_old once, before its first update, and with --beta the
    reference (the adapter off): both of logits / T at --temperature 0.7, as the policy's log-probs and the
    sampler's are (else every ratio and KL is off by the temperature), here against a forward of the model done
    by hand."""
    a = grpo.parse_args(["--model", tiny_dir, "--beta", "0.1", "--num-iterations", "2", "--temperature", "0.7"]
                        + TINY)
    model, tok, _ = grpo.load_model(a, torch.device("cpu"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n or "embed" in n:
                p.normal_(std=0.5)  # an adapter that moves the policy off the reference; logits spread wide
    groups = tiny.fixed_groups(tok, REWARDS, a)
    batch = grpo.prepare(model, None, groups, a, {})[0]
    ids, C, mask = batch["input_ids"], batch["mask"].shape[1], batch["mask"] > 0
    pos = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    def logps(temperature, reference=False):
        with torch.no_grad(), model.disable_adapter() if reference else contextlib.nullcontext():
            logits = model(input_ids=ids, attention_mask=batch["attention_mask"], position_ids=pos).logits
        return (logits[:, -C - 1:-1].float() / temperature).log_softmax(-1).gather(-1, ids[:, -C:, None])[..., 0]
    for name, reference in (("old_logp", False), ("ref_logp", True)):
        assert torch.allclose(batch[name][mask], logps(0.7, reference)[mask], atol=1e-4), name
        assert (logps(1.0, reference) - logps(0.7, reference))[mask].abs().max() > 0.1  # (T shows)
    assert (batch["old_logp"] - batch["ref_logp"])[mask].abs().max() > 0.1  # (the adapter shows)


def test_kl_reference_is_the_base_model(tiny_dir):
    """KL reference = the adapter disabled (no second copy): train_step's kl metric is k3 against the base
    model's log-probs, computed here from a separately loaded base model, and not 0; and the step's other token
    means (entropy, ratio, token loss) by hand."""
    a = grpo.parse_args(["--model", tiny_dir, "--beta", "0.1"] + TINY)
    model, tok, ref = grpo.load_model(a, torch.device("cpu"))
    assert ref is None  # LoRA: no second copy
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(tiny_dir)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()  # a non-zero adapter
    groups = tiny.fixed_groups(tok, REWARDS, a)
    batch = grpo.collate(groups, tok.pad_token_id, "cpu")
    with torch.no_grad():
        C = batch["mask"].shape[1]
        d = grpo.token_logps(base, batch["input_ids"], batch["attention_mask"], C)[0] \
            - grpo.token_logps(model, batch["input_ids"], batch["attention_mask"], C)[0]
    k3 = ((d.exp() - d - 1) * batch["mask"]).sum() / batch["mask"].sum()
    m = grpo.train_step(model, None, torch.optim.SGD(model.parameters(), lr=0.0), groups, a)
    assert k3 > 1e-3 and m["kl"] == pytest.approx(k3.item(), rel=1e-4)
    # the other means over the trained tokens (beta > 0: every row): the policy's entropy from its full logits, the
    # ratio (1: on-policy), the token loss -A_i + beta k3 (clip at r = 1)
    mask = batch["mask"].bool()
    with torch.no_grad():
        pos = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=pos).logits
        p = logits[:, -C - 1:-1].float().softmax(-1)
    assert m["policy/entropy"] == pytest.approx(-(p * p.log()).sum(-1)[mask].mean().item(), rel=1e-4)
    token = -adv_rows(groups, a)[:, None] + 0.1 * (d.exp() - d - 1)
    assert m["loss/token_mean"] == pytest.approx(token[mask].mean().item(), rel=1e-4, abs=1e-6)
    assert m["loss/ratio"] == 1 and m["loss/clipfrac_low"] == m["loss/clipfrac_high"] == 0 and m["train/rows"] == 16
    k2 = (d * d / 2 * batch["mask"]).sum() / batch["mask"].sum()
    for kl in ("k2", "k3_ratio"):  # the metric is k3's value whatever --kl trains (README), here not k2's
        m = grpo.train_step(model, None, torch.optim.SGD(model.parameters(), lr=0.0), groups, replace(a, kl=kl))
        assert m["kl"] == pytest.approx(k3.item(), rel=1e-4) and k2 != pytest.approx(k3.item(), rel=1e-3)
    with torch.no_grad():  # at a temperature, both sides' log-probs are of logits / T
        d = grpo.token_logps(base, batch["input_ids"], batch["attention_mask"], C, 0.5)[0] \
            - grpo.token_logps(model, batch["input_ids"], batch["attention_mask"], C, 0.5)[0]
    m = grpo.train_step(model, None, torch.optim.SGD(model.parameters(), lr=0.0), groups, replace(a, temperature=0.5))
    assert m["kl"] == pytest.approx((((d.exp() - d - 1) * batch["mask"]).sum() / batch["mask"].sum()).item(), rel=1e-4)


def test_a_tensor_step_terms_returns_reaches_token_objective_by_name_and_is_no_input(loaded, monkeypatch):
    """A token set or weight is a name step_terms returns beside adv, loss_mask and keep: it reaches each of
    token_objective's micro-batches, this rank's rows of it, under that name, and probe tells it from an input
    (one a term reads and step_inputs computes): what step_terms writes is no input."""
    a, model, tok = loaded
    step_terms, token_objective, seen = grpo.step_terms, grpo.token_objective, []
    def with_a_weight(s, a, state):  # the fork: a per-token weight, 1 + its place in the step's rows
        made, stats, words = step_terms(s, a, state)
        made["w"] = 1 + torch.arange(made["loss_mask"].numel(), dtype=torch.float).view_as(made["loss_mask"])
        return made, stats, words
    def weighted(logp, entropy, b, a):
        if not isinstance(b, collections.defaultdict):  # (probe's made-up step is one)
            seen.append(b["w"].clone())
        loss, diag, words = token_objective(logp, entropy, b, a)
        return loss * b["w"], diag, words
    monkeypatch.setattr(grpo, "step_terms", with_a_weight)
    monkeypatch.setattr(grpo, "token_objective", weighted)
    assert grpo.probe(a)[0] == set()  # drgrpo reads no input; "w" is written
    groups = tiny.fixed_groups(tok, [[0, 1, 0, 1], [1, 0, 0, 1]], a)
    grpo.train_step(model, None, torch.optim.SGD(model.parameters(), lr=0.0), groups, a)
    C = max(len(r["completion"]) for r in groups)
    assert torch.equal(torch.cat(seen), 1 + torch.arange(8 * C, dtype=torch.float).view(8, C))  # micro-batches 3, 3, 2


def test_a_term_reads_the_reference_s_entropy_by_name_as_it_reads_its_log_probs(loaded):
    """step_inputs computes the inputs a term reads, by name, in micro-batches: ref_logp and ref_entropy are the
    reference's (the policy with its LoRA adapters off), old_logp and old_entropy the policy's, each as token_logps
    gives them for the whole batch at once; what no term reads is not computed."""
    a, model, tok = loaded
    batch = grpo.collate(tiny.fixed_groups(tok, [[0, 1, 0, 1]], a), tok.pad_token_id, "cpu")
    C = batch["mask"].shape[1]
    lora = [p for n, p in model.named_parameters() if "lora_B" in n]
    saved = [p.detach().clone() for p in lora]
    try:
        with torch.no_grad():
            for i, p in enumerate(lora):  # adapters that change the policy: it is not the reference
                p.copy_(10 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
            policy = grpo.token_logps(model, batch["input_ids"], batch["attention_mask"], C, a.temperature)
            with model.disable_adapter():
                reference = grpo.token_logps(model, batch["input_ids"], batch["attention_mask"], C, a.temperature)
        grpo.step_inputs(model, None, batch, {"ref_entropy", "old_logp"}, replace(a, micro_batch_size=3))
    finally:
        with torch.no_grad():
            for p, s in zip(lora, saved):
                p.copy_(s)
    assert torch.allclose(batch["ref_entropy"], reference[1], atol=1e-5)
    assert torch.allclose(batch["ref_logp"], reference[0], atol=1e-5)
    assert torch.allclose(batch["old_logp"], policy[0], atol=1e-5)
    assert (policy[1] - reference[1]).abs().max() > 1e-3  # (the two differ: a swap would show)
    assert grpo.probe(replace(a, beta=0.1))[0] == {"ref_logp"}  # (only what a term reads)


def test_the_step_s_statistics_see_every_rank_s_trained_tokens_as_one_process(loaded, monkeypatch):
    """step_stats gets each of token_objective's diagnostics as (M, C) over every rank's rows in sampling order,
    NaN where it is not defined (a padded token, a row not trained): a statistic that is not a mean (a max, a
    quantile) is a line there. Here a second rank's rows come back from the gather beside this one's, and a
    quantile of the ratio, added in one line, is over both."""
    a, model, tok = loaded
    groups = tiny.fixed_groups(tok, [[0, 1, 0, 1], [1, 1, 1, 1]], a)  # the second group: equal, skipped
    seen, real, stats = [], grpo.all_gather, grpo.step_stats
    def with_a_quantile(d):
        if not isinstance(d, collections.defaultdict):  # (train_step's own call, to find what it reads)
            seen.append(d)
        return {**stats(d), "loss/ratio_q50": d["loss/ratio"].nanquantile(0.5).item()}
    monkeypatch.setattr(grpo, "step_stats", with_a_quantile)
    m = grpo.train_step(model, None, torch.optim.SGD(model.parameters(), lr=0.0), groups, a)
    d = seen[0]
    lengths = [len(r["completion"]) for r in groups]
    want = torch.tensor([[t < n and i < 4 for t in range(max(lengths))] for i, n in enumerate(lengths)])
    assert torch.equal(d["loss/ratio"].isfinite(), want) and torch.equal(d["order"], torch.tensor([0] * 4 + [1] * 4))
    assert m["loss/ratio_q50"] == 1.0 and m["loss/ratio"] == 1.0  # one update: r = 1 on every trained token
    def two_ranks(obj):  # the gather of the tokens: a second rank's rows, the same groups as 2 and 3
        if isinstance(obj, dict) and "loss/ratio" in obj and "order" in obj:
            other = {k: v.clone() for k, v in obj.items()}
            other["order"] += 2
            other["sampler/logp_gap"] = torch.where(other["sampler/logp_gap"].isfinite(), 7.0, math.nan)
            return [obj, other]
        return real(obj)
    for r in groups:  # the sampler's log-probs, known: the gap is defined
        r["logp"] = torch.full((len(r["completion"]),), -3.0)
    monkeypatch.setattr(grpo, "all_gather", two_ranks)
    m = grpo.train_step(model, None, torch.optim.SGD(model.parameters(), lr=0.0), groups, a)
    assert seen[-1]["loss/ratio"].shape[0] == 16 and m["sampler/logp_gap_max"] == 7.0  # the other rank's worst


def test_a_rank_with_no_row_to_train_leaves_the_step_s_metrics_to_the_others(loaded, monkeypatch):
    """Under torchrun a rank may train no row (it kept no group, or only equal-reward ones, skipped) while
    another does: the step's token means and the sampler gap's worst token are the other ranks'. Here the
    gather of the step's sums gets a second, empty rank's beside this one's."""
    a, model, tok = loaded
    groups = tiny.fixed_groups(tok, [[0, 1, 0, 1], [1, 0, 0, 0]], a)
    for r in groups:  # the sampler's log-probs, known
        r["logp"] = torch.full((len(r["completion"]),), -3.0)
    alone = grpo.train_step(model, None, torch.optim.SGD(model.parameters(), lr=0.0), groups, a)
    real = grpo.all_gather
    def with_an_empty_rank(obj):  # the sums of a rank whose chunk loop never ran
        return [obj, {"loss": 0.0, "train/rows": 0}] if isinstance(obj, dict) and "loss" in obj else real(obj)
    monkeypatch.setattr(grpo, "all_gather", with_an_empty_rank)
    m = grpo.train_step(model, None, torch.optim.SGD(model.parameters(), lr=0.0), groups, a)
    assert alone["sampler/logp_gap_max"] > alone["sampler/logp_gap"] > 0
    assert m.keys() == alone.keys() and all(m[k] == alone[k] for k in alone if not k.startswith("time"))


def sgd_update(model, a, groups, pad_id):
    """The parameter change of one train_step with SGD(lr=1) and no clipping: minus the gradient."""
    model = copy.deepcopy(model)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in params.items()}
    opt = torch.optim.SGD(params.values(), lr=1.0)
    m = grpo.train_step(model, None, opt, groups, a)
    return {n: p.detach() - before[n] for n, p in params.items()}, m


def assert_same_update(u, v):
    for n in u:
        assert torch.allclose(u[n], v[n], rtol=1e-4, atol=1e-8), n


REWARDS = [[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize("agg", grpo.LOSS_AGGS)
def test_micro_batches_give_the_one_batch_gradient(loaded, agg):
    a, model, tok = loaded
    a = replace(a, loss_agg=agg, max_grad_norm=0.0, max_new_tokens=6, scale="std")
    groups = tiny.fixed_groups(tok, REWARDS, a)
    whole, m1 = sgd_update(model, replace(a, micro_batch_size=16), groups, tok.pad_token_id)
    micro, m2 = sgd_update(model, replace(a, micro_batch_size=3), groups, tok.pad_token_id)
    assert_same_update(whole, micro)
    assert m1["grad/norm"] > 0 and m1["grad/norm"] == pytest.approx(m2["grad/norm"], rel=1e-4)


def test_the_gradient_is_clipped_to_max_grad_norm_and_logged_before(loaded):
    """grad/norm is the step's gradient norm before clipping (the size of SGD(lr=1)'s unclipped update); with
    --max-grad-norm a quarter of it, the update is a quarter of that one, its norm logged as before."""
    a, model, tok = loaded
    a = replace(a, max_grad_norm=0.0, max_new_tokens=6)
    groups = tiny.fixed_groups(tok, REWARDS, a)
    full, m = sgd_update(model, a, groups, tok.pad_token_id)
    norm = math.sqrt(sum((v.double() ** 2).sum().item() for v in full.values()))
    assert norm > 0 and m["grad/norm"] == pytest.approx(norm, rel=1e-4)
    clipped, m = sgd_update(model, replace(a, max_grad_norm=norm / 4), groups, tok.pad_token_id)
    assert_same_update(clipped, {n: v / 4 for n, v in full.items()})
    assert m["grad/norm"] == pytest.approx(norm, rel=1e-4)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_zero_variance_skip_leaves_the_gradient_unchanged(loaded, agg):
    a, model, tok = loaded
    a = replace(a, loss_agg=agg, max_grad_norm=0.0, max_new_tokens=6)
    groups = tiny.fixed_groups(tok, REWARDS, a)
    skipped, m1 = sgd_update(model, replace(a, skip_zero_variance=True), groups, tok.pad_token_id)
    full, m2 = sgd_update(model, replace(a, skip_zero_variance=False), groups, tok.pad_token_id)
    assert (m1["train/rows"], m2["train/rows"]) == (8, 16)  # two of four groups skipped
    assert_same_update(skipped, full)


def adv_rows(groups, a):
    """Every row's advantage, GRPO's formula (group_advantages, tested by hand above) on each group's rewards."""
    rewards = torch.tensor([r["reward"] for r in groups])
    return grpo.group_advantages(rewards.view(len({r["order"] for r in groups}), -1), a.scale, a.std_eps)[0].flatten()


def hand_update(model, batch, agg, T, beta=0.0, rows=None):
    """Minus the step's gradient, from the definitions and nothing of train_step: on-policy (r = 1) the token
    loss has the value -A and the gradient -A grad log pi, plus beta k3 against the adapter-disabled model; the
    normalisers are counted here: rows (bool, N) left out count in none of them."""
    model = copy.deepcopy(model)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    ids, attn, C = batch["input_ids"], batch["attention_mask"], batch["mask"].shape[1]
    logp, _ = grpo.token_logps(model, ids, attn, C)
    token = -batch["adv"][:, None] * torch.exp(logp - logp.detach())  # batch["adv"]: adv_rows
    if beta:
        with torch.no_grad(), model.disable_adapter():
            ref, _ = grpo.token_logps(model, ids, attn, C)
        token = token + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    seqs = [i for i in range(len(ids)) if rows is None or rows[i]]
    lengths = [batch["mask"][i].sum() for i in seqs]
    sums = [(token[i] * batch["mask"][i]).sum() for i in seqs]
    loss = {"token-mean": sum(sums) / sum(lengths),
            "seq-mean-token-mean": sum(s / n for s, n in zip(sums, lengths)) / len(seqs),
            "seq-mean-token-sum": sum(sums) / len(seqs),
            "seq-mean-token-sum-norm": sum(sums) / (len(seqs) * T)}[agg]
    grads = torch.autograd.grad(loss, list(params.values()))
    return {n: -g for n, g in zip(params, grads)}


@pytest.mark.parametrize("agg", grpo.LOSS_AGGS)
def test_the_step_s_gradient_is_the_papers_and_mask_truncated_drops_rows(loaded, agg):
    """train_step's update (SGD, lr 1) equals the gradient computed by hand: with T = 9 longer than every
    completion (Dr. GRPO divides by T, not by the longest); with --mask-truncated (DAPO §3.4 overlong
    filtering) the truncated rows get no gradient and count in neither normaliser, as if they were not there."""
    a, model, tok = loaded
    a = replace(a, loss_agg=agg, max_grad_norm=0.0, max_new_tokens=6, scale="std", micro_batch_size=3)
    groups = tiny.fixed_groups(tok, REWARDS, a)
    for b in (0, 2):  # two completions of T tokens that did not end (no EOS): each group's last
        r = [r for r in groups if r["order"] == b][3]
        r["completion"] = torch.cat([r["completion"][:-1], torch.tensor([7])])
        r["truncated"] = True
    batch = {**grpo.collate(groups, tok.pad_token_id, "cpu"), "adv": adv_rows(groups, a)}
    kept = ~batch["truncated"]
    assert batch["adv"][~kept].abs().min() > 0.4 and batch["mask"][~kept].sum(1).tolist() == [6, 6]
    plain, _ = sgd_update(model, replace(a, max_new_tokens=9), groups, tok.pad_token_id)
    assert_same_update(plain, hand_update(model, batch, agg, 9))
    masked, m = sgd_update(model, replace(a, mask_truncated=True), groups, tok.pad_token_id)
    want = hand_update(model, batch, agg, 6, rows=kept)
    assert_same_update(masked, want)
    assert not all(torch.allclose(want[n], v, rtol=1e-3) for n, v in hand_update(model, batch, agg, 6).items())
    assert m["train/rows"] == 16 - 8 - 2  # the two zero-variance groups are skipped, and the truncated rows
    prepared = grpo.prepare(model, None, groups, replace(a, mask_truncated=True), {})[0]
    assert torch.equal(prepared["mask"], batch["mask"])  # the completion mask: collate's, as it was
    assert torch.equal(prepared["loss_mask"], batch["mask"] * kept[:, None])  # the loss mask: its own name


def test_with_beta_the_zero_variance_rows_train_their_kl(loaded):
    """The zero-variance skip holds only with beta = 0: with beta > 0 an all-equal group has A = 0 but its KL
    term has a gradient, so its rows train. The step's update equals the hand gradient of
    -A r + beta k3 (k3 against the adapter-disabled model, beta 0.1), summed over every row."""
    a, model, tok = loaded
    model = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05)  # a policy away from the reference: the KL has a gradient
    a = replace(a, beta=0.1, max_grad_norm=0.0, max_new_tokens=6, loss_agg="seq-mean-token-mean")
    groups = tiny.fixed_groups(tok, REWARDS, a)
    u, m = sgd_update(model, a, groups, tok.pad_token_id)
    assert m["train/rows"] == 16 and m["kl"] > 1e-3
    batch = {**grpo.collate(groups, tok.pad_token_id, "cpu"), "adv": adv_rows(groups, a)}
    assert_same_update(u, hand_update(model, batch, a.loss_agg, 6, beta=0.1))


def test_the_entropy_bonus_trains_equal_reward_groups(loaded):
    """With --entropy-coef the gradient at A = 0 is not 0 (probe), so the equal-reward groups are not skipped:
    on two such groups the step trains every row and moves the weights; without it, none."""
    a, model, tok = loaded
    a = replace(a, max_grad_norm=0.0, max_new_tokens=6)
    groups = tiny.fixed_groups(tok, [[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]], a)
    u, m = sgd_update(model, replace(a, entropy_coef=0.01), groups, tok.pad_token_id)
    assert m["train/rows"] == 8 and any(v.abs().max() > 0 for v in u.values())
    u, m = sgd_update(model, a, groups, tok.pad_token_id)
    assert m["train/rows"] == 0 and not any(v.abs().max() > 0 for v in u.values())


def test_full_fine_tuning_with_kl_in_reward_reads_a_frozen_copy(tiny_dir):
    """--lora-r 0 --kl-in-reward: the step reads ref_logp before the advantage, so a frozen copy of the start is
    built (without one, step 1 failed): the KL in the reward is 0 at step 1, then the policy has moved."""
    a = grpo.parse_args(["--model", tiny_dir, "--lora-r", "0", "--kl-in-reward", "0.01", "--beta", "0"] + TINY
                        + ["--max-new-tokens", "6"])
    model, tok, ref = grpo.load_model(a, torch.device("cpu"))
    assert ref is not None and not any(p.requires_grad for p in ref.parameters())
    opt = grpo.make_optimizer(a, model)
    groups = tiny.fixed_groups(tok, REWARDS, a)
    kls = [grpo.train_step(model, ref, opt, groups, a)["kl/in_reward"] for _ in range(2)]
    assert kls[0] == pytest.approx(0, abs=1e-6) and abs(kls[1]) > 1e-4


def test_full_fine_tuning_kl_is_against_a_frozen_copy_of_the_start(tiny_dir):
    """--lora-r 0 --beta > 0: the reference is a frozen copy of the starting model, so kl is 0 at the first step
    and grows as the policy moves, equal each step to k3 against a separately loaded starting model; the
    copy's weights never move."""
    a = grpo.parse_args(["--model", tiny_dir, "--lora-r", "0", "--beta", "0.1"] + TINY + ["--max-new-tokens", "6"])
    model, tok, ref = grpo.load_model(a, torch.device("cpu"))
    assert ref is not None and ref is not model and not any(p.requires_grad for p in ref.parameters())
    frozen = {k: v.clone() for k, v in ref.state_dict().items()}
    from transformers import AutoModelForCausalLM
    start = AutoModelForCausalLM.from_pretrained(tiny_dir)
    opt = grpo.make_optimizer(a, model)
    groups = tiny.fixed_groups(tok, REWARDS, a)
    batch = grpo.collate(groups, tok.pad_token_id, "cpu")
    C, kls = batch["mask"].shape[1], []
    for step in range(3):
        with torch.no_grad():
            d = grpo.token_logps(start, batch["input_ids"], batch["attention_mask"], C)[0] \
                - grpo.token_logps(model, batch["input_ids"], batch["attention_mask"], C)[0]
        k3 = ((d.exp() - d - 1) * batch["mask"]).sum() / batch["mask"].sum()
        kls.append(grpo.train_step(model, ref, opt, groups, a)["kl"])
        assert kls[-1] == pytest.approx(k3.item(), rel=1e-4, abs=1e-12)
    assert kls[0] == pytest.approx(0, abs=1e-8) and 0.001 < kls[1] < kls[2]
    assert all(torch.equal(v, frozen[k]) for k, v in ref.state_dict().items())


def test_bf16_full_fine_tuning_moves_the_weights(tiny_dir):
    """One bf16 full fine-tuning step at the default learning rate changes (nearly) every weight. In pure
    bf16 most would not move: AdamW's first update is ~lr = 2e-5 per weight, while bf16's 8-bit
    mantissa spaces the values near a weight of size 0.02 by ~1e-4. So the weights stay fp32 and the
    forwards run in bf16 autocast."""
    a = grpo.parse_args(["--model", tiny_dir, "--algo", "drgrpo", "--dtype", "bf16", "--lora-r", "0"] + TINY
                        + ["--learning-rate", str(grpo.Args.learning_rate)])
    model, tok, _ = grpo.load_model(a, torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    groups = tiny.fixed_groups(tok, REWARDS, a)
    seen = []  # the dtype the matmuls ran in during the step
    model.get_decoder().layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    grpo.train_step(model, None, grpo.make_optimizer(a, model), groups, a)
    assert set(seen) == {torch.bfloat16}
    n = sum(p.numel() for p in model.parameters())
    moved = sum((p != before[k]).sum().item() for k, p in model.named_parameters())
    kept_in_bf16 = sum((p.to(torch.bfloat16) != before[k].to(torch.bfloat16)).sum().item()
                       for k, p in model.named_parameters())  # what pure bf16 weights would have kept
    assert moved / n > 0.9 and kept_in_bf16 / n < 0.5, (moved / n, kept_in_bf16 / n)


@pytest.mark.parametrize("algo, dtype", [("grpo", "bf16"), ("dapo", "fp32")])
def test_one_step_at_the_full_vocabulary_width(wide_dir, algo, dtype):
    """151,936 logits a token, as Qwen2.5: every sampled id decodes, the step trains, entropy is in range."""
    a = grpo.parse_args(["--model", wide_dir, "--algo", algo, "--dtype", dtype] + TINY)
    model, tok, ref = grpo.load_model(a, torch.device("cpu"))
    assert model.get_output_embeddings().weight.shape[0] == len(tok) == 151936
    groups, stats = rollout(a, model, tok, stub_reward(lambda i: float(i % 2)))
    ids = torch.cat([r["completion"] for r in groups])
    assert ids.max() < len(tok) and all(isinstance(r["text"], str) for r in groups)
    m = grpo.train_step(model, ref, grpo.make_optimizer(a, model), groups, a)
    assert m["grad/norm"] > 0 and math.isfinite(m["loss"]) and math.isfinite(m["kl"])
    assert 0 < m["policy/entropy"] <= math.log(len(tok)) + 1e-3


class Largest(TorchDispatchMode):
    """Records the largest tensor an op makes (not a view of, nor one written into, a tensor it was given):
    its bytes, the op and its shape."""
    def __init__(self):
        super().__init__()
        self.top = (0, "", ())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {x.untyped_storage().data_ptr() for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)}
        for x in tree_leaves(out):
            if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() not in given:
                self.top = max(self.top, (x.untyped_storage().nbytes(), str(func), tuple(x.shape)))
        return out


@pytest.fixture(scope="session")
def qwen_width_dir(tmp_path_factory):
    """Qwen2.5-0.5B's widths (vocabulary 151,936, hidden 896, MLP 4,864, 14 heads, 2 KV heads), 2 layers."""
    return tiny.make_tiny(str(tmp_path_factory.mktemp("qwen_width") / "model"), layers=2, **tiny.QWEN25_05B)


@pytest.mark.parametrize("compiled", [False, True])
def test_sampling_and_a_step_hold_what_the_design_says_at_qwen2_5_0_5b_s_width(qwen_width_dir, compiled):
    """What decides who can run the headline command is memory, so each phase's largest tensor is bounded by
    design, measured op by op. Sampling 8 rows: one position's logits, (N, V) in fp32 (grpo.decode_step), or the
    prefill's widest activation, (N, P, MLP) in fp32 (LoRA's); (N, 2, V) logits or the prefill's (N, P, V) are far
    over. A training step: one output-layer chunk, (2^24 // V, V) in fp32 (grpo.token_logps), not (N, C, V) (128
    tokens here); and with --gradient-checkpointing what the forward saves for backward is the layers' inputs
    and two more of their size in fp32 (the final norm's, the head's input), so no chunk's logits are kept."""
    a = grpo.parse_args(["--model", qwen_width_dir, "--max-new-tokens", "16", "--dtype", "bf16",
                         "--gradient-checkpointing", "--prompts-per-step", "2", "--num-generations", "4",
                         "--system-prompt", ""])
    model, tok, _ = grpo.load_model(a, torch.device("cpu"))
    V, H, MLP, layers = 151936, 896, 4864, 2
    P = 24 if compiled else len(tok(grpo.chat_prompt(tok, "1+1?", "")).input_ids)  # compiled: padded to 24
    sampler = grpo.make_sampler(model, a, P, 8, compiled=True) if compiled else None
    torch.manual_seed(0)
    rows = [{"record": {"prompt": q, "answer": ""}} for q in ("1+1?", "2+3?") for _ in range(4)]
    with Largest() as sampling:
        grpo.generate(model, tok, rows, a, sampler=sampler)
    assert len(rows) == 8 and sampling.top[0] <= max(8 * V * 4, 8 * P * MLP * 4) < 8 * 2 * V * 4, sampling.top
    assert len(rows[0]["prompt_ids"]) == len(tok(grpo.chat_prompt(tok, "1+1?", "")).input_ids)  # P, as rendered
    for i, r in enumerate(rows):  # two groups, rewards 1 0 0 1
        r.update(is_teacher=False, reward=[1.0, 0, 0, 1][i % 4], order=i // 4, rewards={})
    prompts, comps = [r["prompt_ids"] for r in rows], [r["completion"] for r in rows]
    saved = []
    def pack(x):
        saved.append(x.untyped_storage().nbytes())
        return x
    with Largest() as training, torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        m = grpo.train_step(model, None, torch.optim.SGD(model.parameters(), lr=0.0), rows, a)
    tokens = sum(map(len, comps))
    assert m["train/rows"] == 8 and tokens * V * 4 > training.top[0] == 2 ** 24 // V * V * 4, training.top
    L = max(map(len, prompts)) + max(map(len, comps))  # the rows' length in the step
    assert 0 < sum(saved) <= (layers + 2) * 8 * L * H * 4, (sum(saved), max(saved))


@pytest.mark.parametrize("lora_r", ["16", "0"])
def test_gradient_checkpointing_recomputes_each_layer_in_backward(tiny_dir, lora_r):
    """With --gradient-checkpointing a decoder layer runs twice per training micro-batch (forward, then
    again in backward), once without; the model trains in train mode (from_pretrained gives eval mode,
    where transformers skips checkpointing) and generate() leaves it there."""
    calls = {}
    for gc in (False, True):
        a = grpo.parse_args(["--model", tiny_dir, "--algo", "drgrpo", "--lora-r", lora_r] + TINY
                            + ["--micro-batch-size", "8"] + ["--gradient-checkpointing"] * gc)
        model, tok, ref = grpo.load_model(a, torch.device("cpu"))
        grpo.generate(model, tok, [{"record": {"prompt": "1+1?", "answer": "2"}} for _ in range(2)], a)
        assert model.training and model.get_decoder().layers[0].training
        runs = []
        model.get_decoder().layers[0].mlp.register_forward_pre_hook(lambda *_: runs.append(1))
        groups = tiny.fixed_groups(tok, [[0, 1], [1, 0]], a)
        grpo.train_step(model, ref, grpo.make_optimizer(a, model), groups, a)  # one micro-batch, no KL
        calls[gc] = len(runs)
    assert calls == {False: 1, True: 2}


def test_lora_dropout_is_applied_in_training(tiny_dir):
    a = grpo.parse_args(["--model", tiny_dir, "--lora-dropout", "0.5"] + TINY)
    model, tok, _ = grpo.load_model(a, torch.device("cpu"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()  # a non-zero adapter, so dropping its input shows
        ids = torch.randint(4, len(tok), (2, 12))
        first, second = (grpo.token_logps(model, ids, torch.ones_like(ids), 6)[0] for _ in range(2))
    assert not torch.equal(first, second)


def test_parameters_change_after_one_step(loaded):
    a, model, tok = loaded
    model = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    groups = tiny.fixed_groups(tok, REWARDS, a)
    grpo.train_step(model, None, grpo.make_optimizer(a, model), groups, a)
    changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert all("lora" in n for n in before)  # only the adapter trains
    # B starts at 0, so dL/dA = 0 at step one: every B changes, A only from step two
    assert changed == [n for n in before if "lora_B" in n] and changed


@pytest.mark.parametrize("agg", grpo.LOSS_AGGS)
def test_a_small_step_raises_the_surrogate_objective(loaded, agg):
    """The step goes uphill: sum_i w_i A_i sum_t logp_it (the policy-gradient surrogate) increases,
    i.e. positive-advantage completions become likelier and negative ones less likely."""
    a, model, tok = loaded
    a = replace(a, loss_agg=agg, max_grad_norm=0.0, max_new_tokens=6)
    groups = tiny.fixed_groups(tok, REWARDS, a)
    batch = {**grpo.collate(groups, tok.pad_token_id, "cpu"), "adv": adv_rows(groups, a)}

    def surrogate(m):
        with torch.no_grad():
            logp, _ = grpo.token_logps(m, batch["input_ids"], batch["attention_mask"], batch["mask"].shape[1])
        return -grpo.aggregate_loss(-logp * batch["adv"][:, None], batch["mask"], agg, 6)[0].item()
    model = copy.deepcopy(model)
    before = surrogate(model)
    grpo.train_step(model, None, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2),
                    groups, a)
    assert surrogate(model) > before


def test_num_iterations_uses_old_logp_from_before_the_first_update(loaded):
    """With 2 iterations the second update sees ratio != 1 (old_logp frozen before the first)."""
    a, model, tok = loaded
    a = replace(a, num_iterations=2, learning_rate=0.05, max_grad_norm=0.0, eps_low=1e-4, eps_high=1e-4)
    model = copy.deepcopy(model)
    m = grpo.train_step(model, None, grpo.make_optimizer(a, model),
                        tiny.fixed_groups(tok, REWARDS, a), a)
    assert m["loss/clipfrac_low"] + m["loss/clipfrac_high"] > 0  # the second pass is off-policy and clips


def stub_reward(schedule):
    """A reward whose value depends on how many times it was called: round r, group g, row j."""
    calls = []

    def fn(text, answer, **kw):
        calls.append(1)
        return schedule(len(calls) - 1)
    return fn


def rollout(a, model, tok, fn, pool=None):
    """grpo.rollout's groups to train and its metrics, with the advantages the step makes of them (prepare)."""
    stream = grpo.prompt_stream(grpo.arithmetic_task(100, 0), 0)
    fns = [("stub", fn, 1.0)] + [f for f in grpo.build_rewards(a) if f[0] == "overlong"]  # (--overlong-penalty's)
    groups, stats, _ = grpo.rollout(model, tok, stream, fns, pool, a, {"prompts_drawn": 0})
    if groups:
        stats.update(grpo.prepare(model, None, groups, a, {})[-1])
    return groups, stats


def test_the_overlong_penalty_reaches_the_reward(loaded, monkeypatch):
    """--algo dapo: R = the reward + DAPO's overlong penalty of each completion's length in tokens, counting the
    EOS that ended it (T = 12, L_cache = 4: 0 up to 8 tokens, then (8 - |o|) / 4), by hand. A reward is given the
    text without the EOS (special tokens skipped) and that length."""
    _, model, tok = loaded
    a = grpo.parse_args(["--algo", "dapo", "--overlong-buffer", "4"] + TINY)
    lengths, cut = [2, 8, 9, 11, 12, 12, 3, 10], [False] * 5 + [True] + [False] * 2

    def fake_sample(model, tok_, held, new_tokens, a, greedy=False, sampler=None, temps=None):  # generate's rows
        drawn = torch.full((len(held), max(lengths)), tok.pad_token_id)
        for r, (k, c) in enumerate(zip(lengths, cut)):
            drawn[r, :k] = torch.tensor([7] * (k - 1) + [7 if c else tok.eos_token_id])
        return drawn, torch.zeros(drawn.shape)
    monkeypatch.setattr(grpo, "sample", fake_sample)
    stream = grpo.prompt_stream(grpo.arithmetic_task(100, 0), 0)
    seen = []

    def judge(text, answer, length, **kw):  # 0, 1, 0, 1, ... and what a reward is given
        seen.append((text, length))
        return float((len(seen) - 1) % 2)
    fns = [("stub", judge, 1.0), grpo.build_rewards(a)[-1]]  # (dapo's rewards: correct_pm1, overlong)
    _, _, generated = grpo.rollout(model, tok, stream, fns, None, a, {"prompts_drawn": 0})
    penalty = [0, 0, -0.25, -0.75, -1, -1, 0, -0.5]
    assert [r["reward"] for r in generated] == pytest.approx([i % 2 + p for i, p in enumerate(penalty)])
    assert [r["rewards"]["overlong"] for r in generated] == pytest.approx(penalty)  # a reward: reward/overlong
    assert seen == [(tok.decode([7] * (k - (not c))), k) for k, c in zip(lengths, cut)]  # the text without its EOS


def test_dynamic_sampling_refills_to_b_groups(loaded):
    a, model, tok = loaded
    a = replace(a, prompts_per_step=4, num_generations=2, dynamic_sampling=True, max_gen_rounds=5)
    per_round = 4 * 2
    # round 0: every group equal (all dropped); rounds 1+: even groups differ, odd groups equal
    fn = stub_reward(lambda i: 0.0 if i < per_round else float((i % per_round) // 2 % 2 == 0 and i % 2))
    rows, stats = rollout(a, model, tok, fn)
    orders = sorted({r["order"] for r in rows})
    assert (stats["groups/kept"], stats["groups/gen_rounds"], len(orders), len(rows)) == (4, 3, 4, 8)
    assert all([r["reward"] for r in rows if r["order"] == o] == [0.0, 1.0] for o in orders)
    assert stats["reward/mean"] == pytest.approx(4 / 24)  # metrics see every completion generated, kept or not


def test_dynamic_sampling_keeps_exactly_b_and_stops_at_the_cap(loaded):
    a, model, tok = loaded
    a = replace(a, prompts_per_step=4, num_generations=2, dynamic_sampling=True, max_gen_rounds=3)
    groups, stats = rollout(a, model, tok, stub_reward(lambda i: float(i % 2)))  # every group differs
    assert (stats["groups/kept"], stats["groups/gen_rounds"]) == (4, 1)
    groups, stats = rollout(a, model, tok, stub_reward(lambda i: 1.0))  # never a useful group
    assert (stats["groups/kept"], stats["groups/gen_rounds"], groups) == (0, 3, [])


def test_top_k_and_soft_reweighting(loaded):
    a, model, tok = loaded
    a = replace(a, prompts_per_step=4, num_generations=2, top_k_groups=2, soft_reweight=True, scale="none")
    spread = [0.0, 3.0, 0.0, 1.0, 0.0, 2.0, 5.0, 5.0]  # group stds ∝ 3, 1, 2, 0
    rows, stats = rollout(a, model, tok, stub_reward(lambda i: spread[i]))
    assert [[r["reward"] for r in rows if r["order"] == o] for o in (0, 2)] == [[0.0, 3.0], [0.0, 2.0]]
    assert [r["order"] for r in rows] == [0, 0, 2, 2]  # the two kept groups, in sampling order
    # Dr. GRPO advantages R - mean, times std_g / max std over the kept groups (3/√2 and 2/√2 -> 1 and 2/3)
    assert [r["adv"] for r in rows] == pytest.approx([-1.5, 1.5, -2 / 3, 2 / 3], rel=1e-5)
    assert (stats["adv/soft_weight_min"], stats["adv/soft_weight_max"]) == pytest.approx((2 / 3, 1.0), rel=1e-5)


def test_split_grads_sum_to_the_full_batch_gradient(loaded):
    """g_s + g_t (same normaliser, several micro-batches) equals the gradient of the full loss."""
    a, model, tok = loaded
    a = replace(a, max_grad_norm=0.0, micro_batch_size=3, max_new_tokens=6, teacher_per_group=2,
                teacher_pool="pool.jsonl", num_generations=2)
    groups = tiny.fixed_groups(tok, REWARDS, a, teacher_per_group=2)
    split, m = sgd_update(model, replace(a, split_grads=True), groups, tok.pad_token_id)
    full, m_full = sgd_update(model, a, groups, tok.pad_token_id)
    assert_same_update(split, full)
    ns, nt, cos = m["grad/norm_student"], m["grad/norm_teacher"], m["grad/cos_student_teacher"]
    assert ns > 0 and nt > 0 and -1 <= cos <= 1
    assert m["grad/norm"] ** 2 == pytest.approx(ns ** 2 + nt ** 2 + 2 * ns * nt * cos, rel=1e-4)
    assert m["grad/norm"] == pytest.approx(m_full["grad/norm"], rel=1e-4)


def test_skipping_the_reset_between_passes_double_counts_g_s(loaded):
    """Why train_step zeroes .grad between the two backwards: grad accumulates."""
    a, model, tok = loaded
    a = replace(a, max_new_tokens=6)
    model = copy.deepcopy(model)
    groups = tiny.fixed_groups(tok, REWARDS[:1], a, teacher_per_group=2)
    batch = {**grpo.collate(groups, tok.pad_token_id, "cpu"), "adv": adv_rows(groups, a)}
    params = [p for p in model.parameters() if p.requires_grad]
    logp, _ = grpo.token_logps(model, batch["input_ids"], batch["attention_mask"], batch["mask"].shape[1])
    loss = grpo.policy_loss(logp, logp.detach(), batch["adv"][:, None], batch["mask"], a)[0]
    teacher = batch["is_teacher"][:, None].float()
    part = lambda w: grpo.aggregate_loss(loss, batch["mask"] * w, "token-mean", 6, 4, batch["mask"].sum())[0]  # noqa
    full = torch.autograd.grad(part(1.0), params, retain_graph=True)
    g_s = torch.autograd.grad(part(1 - teacher), params, retain_graph=True)
    part(1 - teacher).backward(retain_graph=True)  # naive: no reset before the teacher pass
    part(teacher).backward()
    naive_g_t = [p.grad for p in params]
    naive = [s + t for s, t in zip(g_s, naive_g_t)]
    assert all(torch.allclose(n, f + s, atol=1e-7) for n, f, s in zip(naive, full, g_s))  # full + an extra g_s
    assert not all(torch.allclose(n, f, atol=1e-7) for n, f in zip(naive, full))


@pytest.mark.parametrize("estimator, scale", [("grpo", "none"), ("grpo", "std"), ("rloo", "none"),
                                              ("reinforce_plus_plus_baseline", "none")])
def test_teacher_rewards_come_from_the_pool_and_share_the_group_advantage(loaded, tmp_path, estimator, scale):
    """Teacher rows: the pool's reward as it is (the overlong penalty shapes only the sampled rows' rewards), their
    tokens the text + EOS, never truncated; one group-relative advantage over G_s + G_t = 4 rows, by hand for each
    estimator (gdpo refuses the pool): R - mean, / std, RLOO's leave-one-out mean of the other 3 (G / (G - 1) with
    G = 4, not G_s = 2), REINFORCE++'s whitening over both groups' tokens (a teacher row's |o_i| counts too)."""
    a, model, tok = loaded
    data = grpo.arithmetic_task(100, 0)
    pool = write(tmp_path / "pool.jsonl", [json.dumps({"prompt": ex["prompt"], "completion": c, "reward": r})
                                           for ex in data for c, r in (("<think>t</think><answer>1</answer>", 1.0),
                                                                        ("I give up", 0.25))])
    a = replace(a, prompts_per_step=2, num_generations=2, teacher_per_group=2, teacher_pool=pool, scale=scale,
                max_new_tokens=40, overlong_penalty=True, overlong_buffer=30, adv_estimator=estimator)  # from 11 tokens
    rows, _ = rollout(a, model, tok, stub_reward(lambda i: float(i % 2) * 0.5), grpo.load_teacher_pool(a, data, tok))
    assert [r["order"] for r in rows] == [0, 0, 0, 0, 1, 1, 1, 1]
    centred, lengths = [], []
    for g in (rows[:4], rows[4:]):
        assert [x["is_teacher"] for x in g] == [False, False, True, True]
        r = [x["reward"] for x in g]
        assert sorted(r[2:]) == [0.25, 1.0]  # frozen, from the pool, not rescored
        penalty = [-max(0, len(x["completion"]) - 10) / 30 for x in g[:2]]  # DAPO's, by hand
        assert r[:2] == pytest.approx([0.0 + penalty[0], 0.5 + penalty[1]])
        mean = sum(r) / 4  # one group-relative advantage over G_s + G_t
        want = {"none": [x - mean for x in r], "std": [(x - mean) / (statistics.stdev(r) + 1e-6) for x in r]}[scale]
        if estimator == "rloo":
            want = [x - sum(r[j] for j in range(4) if j != i) / 3 for i, x in enumerate(r)]
        if estimator != "reinforce_plus_plus_baseline":
            assert [x["adv"] for x in g] == pytest.approx(want)
        centred += [x - mean for x in r]
        lengths += [len(x["completion"]) for x in g]
        text = dict((x["text"], x["completion"]) for x in g)["I give up"]
        assert text.tolist() == tok("I give up", add_special_tokens=False).input_ids + [tok.eos_token_id]
        assert [x["truncated"] for x in g[2:]] == [False, False]
    if estimator == "reinforce_plus_plus_baseline":  # whitened over the step's tokens, each row |o_i| times
        tokens = [c for c, n in zip(centred, lengths) for _ in range(n)]
        mu, var = statistics.mean(tokens), statistics.variance(tokens)
        assert [x["adv"] for x in rows] == pytest.approx([(c - mu) / math.sqrt(var + 1e-8) for c in centred])


def test_a_step_that_trains_nothing_logs_no_entropy(loaded):
    a, model, tok = loaded
    a = replace(a, num_generations=2)
    groups = tiny.fixed_groups(tok, [[1.0, 1.0], [0.0, 0.0]], a)  # all-equal groups: all skipped
    m = grpo.train_step(copy.deepcopy(model), None, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0),
                        groups, a)
    assert m["train/rows"] == 0 and m["loss"] == 0 and "policy/entropy" not in m and "loss/token_mean" not in m


def test_a_rank_with_no_group_joins_the_step_with_an_empty_batch(loaded):
    """Under torchrun a rank may keep no group (dynamic sampling, top-k): collate gives it N = 0 rows and
    train_step runs its reductions without a forward."""
    a, model, tok = loaded
    batch = grpo.collate([], tok.pad_token_id, "cpu")
    assert batch["input_ids"].shape == (0, 0) and batch["reward"].shape == batch["truncated"].shape == (0,)
    m = grpo.train_step(copy.deepcopy(model), None, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0),
                        [], a)
    assert m == {"grad/norm": 0.0, "loss": 0.0, "train/rows": 0.0}


def test_token_logps_and_their_gradient_equal_the_full_logits(loaded):
    """The chunked, recomputed output layer gives the log-probs, entropy and LoRA gradient of a plain forward
    over the full (N, P+C, V) logits, at a temperature."""
    a, model, tok = loaded
    model = copy.deepcopy(model)
    torch.manual_seed(0)
    ids, C, g = torch.randint(4, len(tok), (3, 12)), 5, torch.randn(3, 5)
    logp, entropy = grpo.token_logps(model, ids, torch.ones_like(ids), C, 0.7)
    lora = [p for n, p in model.named_parameters() if "lora" in n]
    grad = torch.autograd.grad((logp * g).sum(), lora)
    z = (model(input_ids=ids).logits[:, -C - 1:-1].float() / 0.7).log_softmax(-1)  # (N, C, V)
    want = z.gather(-1, ids[:, -C:, None])[..., 0]
    assert torch.allclose(logp, want, atol=1e-5)
    assert torch.allclose(entropy, -(z.exp() * z).sum(-1), atol=1e-4)
    for got, exp in zip(grad, torch.autograd.grad((want * g).sum(), lora)):
        assert torch.allclose(got, exp, atol=1e-5)


def test_a_non_finite_step_is_not_applied(loaded):
    """A NaN reward, so NaN advantages: no update, the optimizer's state untouched, the step flagged and its
    metrics left out."""
    a, model, tok = loaded
    model = copy.deepcopy(model)
    opt = grpo.make_optimizer(a, model)
    groups = tiny.fixed_groups(tok, [[1.0, 0.0, 0.5, 0.2]], a)
    grpo.train_step(model, None, opt, groups, a)  # a state to keep
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = copy.deepcopy(opt.state_dict())
    for row, reward in zip(groups, [float("nan"), 1.0, -1.0, 0.0]):
        row["reward"] = reward
    m = grpo.train_step(model, None, opt, groups, a)
    assert m["train/not_finite"] == 1.0 and "grad/norm" not in m and "loss" not in m
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    after = opt.state_dict()
    assert all(torch.equal(state["state"][i][k], after["state"][i][k]) for i in state["state"] for k in state["state"][i])


def test_a_later_non_finite_iteration_keeps_the_earlier_updates_and_says_so(loaded, monkeypatch):
    """--num-iterations 3, NaN from the second on: the first update is applied and the step says 1 update."""
    a, model, tok = loaded
    a = replace(a, num_iterations=3)
    model = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.named_parameters() if v.requires_grad}
    real, calls = grpo.policy_loss, []
    def poisoned(logp, *args):
        calls.append(1)
        loss, diag, words = real(logp, *args)
        return (loss * float("nan") if len(calls) > 1 + 3 else loss), diag, words  # the probe, 3 micro-batches
    monkeypatch.setattr(grpo, "policy_loss", poisoned)
    m = grpo.train_step(model, None, grpo.make_optimizer(a, model), tiny.fixed_groups(tok, REWARDS, a), a)
    assert len(calls) == 1 + 6 and m["train/not_finite"] == 1.0 and m["train/updates"] == 1
    assert any(not torch.equal(before[k], v) for k, v in model.named_parameters() if v.requires_grad)


def test_the_loss_logged_is_the_scalar_optimised(loaded):
    """On policy (r = 1, beta 0) every token's loss is -A_i: the step's loss is Σ_i -A_i |o_i| / (n_seq T)
    under Dr. GRPO's aggregation, and -Σ_i A_i |o_i| / Σ_i |o_i| under token-mean."""
    a, model, tok = loaded
    groups = tiny.fixed_groups(tok, REWARDS, a)
    lengths, adv = grpo.collate(groups, tok.pad_token_id, "cpu")["mask"].sum(1), adv_rows(groups, a)
    for agg, want in [("seq-mean-token-sum-norm", -(adv * lengths).sum() / (len(adv) * a.max_new_tokens)),
                      ("token-mean", -(adv * lengths).sum() / lengths.sum())]:
        b = replace(a, loss_agg=agg, skip_zero_variance=False)
        m = grpo.train_step(copy.deepcopy(model), None, torch.optim.SGD([torch.zeros(1, requires_grad=True)]),
                            groups, b)
        assert m["loss"] == pytest.approx(want.item(), abs=1e-6)
        assert m["loss/token_mean"] == pytest.approx((-(adv * lengths).sum() / lengths.sum()).item(), abs=1e-6)


def test_no_checkpoint_is_written_from_weights_that_are_not_finite(loaded, tmp_path):
    a, model, tok = loaded
    a = replace(a, output_dir=str(tmp_path))
    grpo.save(model, tok, a, {"step": 1, "prompts_drawn": 0, "rng": [], "optimizer": {}})
    model = copy.deepcopy(model)
    next(p for p in model.parameters() if p.requires_grad).data[0, 0] = float("nan")
    with pytest.raises(SystemExit, match="weights are not finite at step 2: nothing saved"):
        grpo.save(model, tok, a, {"step": 2, "prompts_drawn": 0, "rng": [], "optimizer": {}})
    assert json.load(open(tmp_path / "checkpoint" / "grpo_args.json"))["step"] == 1


SAVE_STEPS = ("rmtree", "save_pretrained", "torch.save", "replace")


def test_a_save_killed_at_any_point_leaves_a_whole_checkpoint(loaded, tmp_path, monkeypatch):
    """Fail the save at each of its file operations in turn: a whole checkpoint (the old or the new one) is
    always found where --resume looks, and the next save then succeeds over the leftovers."""
    a, model, tok = loaded
    a = replace(a, output_dir=str(tmp_path))
    state = lambda step: {"step": step, "prompts_drawn": 0, "rng": [], "optimizer": {}}  # noqa: E731
    grpo.save(model, tok, a, state(1))
    real = {"rmtree": grpo.shutil.rmtree, "replace": grpo.os.replace, "torch.save": grpo.torch.save}
    n_ops = 0

    def count(name, fn):
        def wrapped(*args, **kw):
            nonlocal n_ops
            n_ops += 1
            if n_ops == fail_at:
                raise KeyboardInterrupt(f"killed at {name}")
            return fn(*args, **kw)
        return wrapped
    fail_at = 0
    for fail_at in range(1, 30):
        n_ops = 0
        with monkeypatch.context() as m:
            m.setattr(grpo.shutil, "rmtree", count("rmtree", real["rmtree"]))
            m.setattr(grpo.os, "replace", count("replace", real["replace"]))
            m.setattr(grpo.torch, "save", count("torch.save", real["torch.save"]))
            try:
                grpo.save(model, tok, a, state(fail_at + 1))
            except KeyboardInterrupt:
                pass
            else:
                break
        ckpt = grpo.last_checkpoint(str(tmp_path))
        step = json.load(open(os.path.join(ckpt, "grpo_args.json")))["step"]
        assert step in (fail_at, fail_at + 1) and torch.load(os.path.join(ckpt, "trainer_state.pt"))["step"] == step
        import peft
        peft.PeftModel.from_pretrained(copy.deepcopy(model.get_base_model()), ckpt)  # loads
        grpo.save(model, tok, a, state(fail_at + 1))  # the next save works over whatever was left
        assert grpo.last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint")
    assert fail_at > 5  # every operation of the save was failed once


def full_disk(obj, f):
    """What torch.save raises writing to a file on a full disk (a full tmpfs, torch 2.13): its own error, over the
    OSError of the write (to a path, only its own: 'basic_ios::clear: iostream error', no errno)."""
    try:
        f.write(bytes(64))
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")


def test_a_failed_save_removes_its_partial_copy_and_names_the_last_checkpoint(loaded, tmp_path, monkeypatch):
    """A full disk as torch.save meets it (its RuntimeError, over the OSError: errno 28 is what is said), as a
    file's writes meet it (/dev/full) and as the adapter's write does (safetensors' own error, once a 24-line
    traceback): one line, the partial copy removed, the last checkpoint named and kept."""
    from safetensors import SafetensorError
    a, model, tok = loaded
    a = replace(a, output_dir=str(tmp_path))
    grpo.save(model, tok, a, {"step": 1, "prompts_drawn": 0, "rng": [], "optimizer": {}})

    def state_on_dev_full(path, *args, **kw):  # trainer_state.pt's writes on a full disk, as torch makes them
        return open("/dev/full" if str(path).endswith("trainer_state.pt") else path, *args, **kw)
    def adapter_full(path, **kw):  # what safetensors raises there, the file begun
        os.makedirs(path, exist_ok=True)
        (pathlib.Path(path) / "adapter_model.safetensors").write_bytes(bytes(64))
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    for target, name, fn in ((grpo.torch, "save", full_disk), (grpo, "open", state_on_dev_full),
                             (model, "save_pretrained", adapter_full)):
        with monkeypatch.context() as m:
            m.setattr(target, name, fn, raising=False)  # (grpo.open: grpo's, not the builtin)
            with pytest.raises(SystemExit, match=f"^grpo: error: saving step 2 failed .*No space left on device.*; "
                                                 f"last checkpoint: {tmp_path}/checkpoint$"):
                grpo.save(model, tok, a, {"step": 2, "prompts_drawn": 0, "rng": [], "optimizer": {}})
        assert not (tmp_path / "checkpoint.tmp").exists()
        assert json.load(open(tmp_path / "checkpoint" / "grpo_args.json"))["step"] == 1


@pytest.mark.parametrize("full_at, saved", [(2, 1), (0, None)])  # 0: the evaluation before the first step
def test_a_full_disk_while_metrics_are_written_is_one_line(tiny_dir, tmp_path, monkeypatch, full_at, saved):
    out = str(tmp_path / "out")
    open_log = grpo.open_log

    class Full:  # metrics.jsonl on a disk that fills up at step 2
        def __init__(self, f):
            self.f = f
        def write(self, line):
            if line.startswith(f'{{"step": {full_at},'):
                raise OSError(28, "No space left on device")
            return self.f.write(line)
        def __getattr__(self, name):
            return getattr(self.f, name)
    monkeypatch.setattr(grpo, "open_log", lambda a, name, step: Full(open_log(a, name, step)))
    last = f"{out}/checkpoint" if saved else "none"
    with pytest.raises(SystemExit, match=rf"^grpo: error: writing step {full_at}'s metrics failed \(\[Errno 28\] No "
                                         rf"space left on device\); last checkpoint: {last}$"):
        main(["--model", tiny_dir, "--output-dir", out, "--max-steps", "3", "--save-every", "1"] + TINY)
    assert saved is None or json.load(open(out + "/checkpoint/grpo_args.json"))["step"] == saved


def test_a_diverged_model_stops_sampling_with_one_line(loaded):
    """Logits that are not finite (weights blown up by a huge learning rate) stop the run in one line that
    names --learning-rate, greedy or sampled, not a traceback inside the sampler."""
    a, model, tok = loaded
    model = copy.deepcopy(model)
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n).fill_(math.inf)
    for greedy in (False, True):
        with pytest.raises(SystemExit, match="logits are not finite: training diverged; lower --learning-rate"):
            grpo.generate(model, tok, [{"record": {"prompt": "1+1?", "answer": "2"}} for _ in range(2)], a,
                          greedy=greedy)



# ----------------------------------------------------------------------------- tool calls in the rollout
CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>'
# Qwen2.5-Instruct's turn of tool results and the next turn's start, written out (its template's words)
RESULTS = "\n<|im_start|>user{}<|im_end|>\n<|im_start|>assistant\n"
RESULT = "\n<tool_response>\n{}\n</tool_response>"


def scripted(tok, script, held=None, logp=-0.5):
    """A stand-in for grpo.sample: its k-th call draws script[k][r] for its r-th row (the text, then EOS), each
    token at log-prob `logp`, padded after; `held` gets what each call's rows held (a prompt and all after it)."""
    turns = iter(script)

    def sample(model, tok_, rows, new_tokens, a, greedy=False, sampler=None, temps=None):
        if held is not None:
            held.append([r.tolist() for r in rows])
        drawn = [tok(t, add_special_tokens=False).input_ids + [tok.eos_token_id] for t in next(turns)]
        out = torch.full((len(drawn), max(map(len, drawn))), tok.pad_token_id)
        for r, ids in enumerate(drawn):
            out[r, :len(ids)] = torch.tensor(ids)
        return out, torch.full(out.shape, logp)
    return sample


def test_a_completion_with_two_tool_turns_by_hand(tools_loaded, monkeypatch):
    """A row calls the calculator, then twice in one turn (one call fails), then answers; its neighbour answers at
    once. The completion is every token after the prompt: each turn drawn with its EOS, then the results as
    Qwen2.5's template writes them and the next turn's start; the tool mask is 1 on the drawn tokens alone, the
    sampler's log-probs NaN on the others; only the row that called draws again, after all it holds."""
    a, model, tok, tools = tools_loaded
    a = replace(a, max_new_tokens=500, system_prompt="")
    turns = [CALL.format("6*7"), "Two more. " + CALL.format("2**10") + CALL.format("1/0"), "\\boxed{42}"]
    held = []
    monkeypatch.setattr(grpo, "sample", scripted(tok, [[turns[0], "\\boxed{1}"], turns[1:2], turns[2:]], held))
    prompt = grpo.chat_prompt(tok, "What is 6*7?", "", tools)
    rows = [{"record": {"prompt": "What is 6*7?", "answer": "42"}} for _ in range(2)]
    grpo.generate(model, tok, rows, a, tools=tools)
    prompts, comps, truncated, logps, masks, calls = ([r[k] for r in rows] for k in (
        "prompt_ids", "completion", "truncated", "logp", "tool_mask", "tool_calls"))
    ids = lambda text: tok(text, add_special_tokens=False).input_ids  # noqa: E731
    eos = [tok.eos_token_id]
    results = [RESULTS.format(RESULT.format(42)),
               RESULTS.format(RESULT.format(1024) + RESULT.format("error: ZeroDivisionError: division by zero"))]
    pieces = [(ids(turns[0]) + eos, 1), (ids(results[0]), 0), (ids(turns[1]) + eos, 1), (ids(results[1]), 0),
              (ids(turns[2]) + eos, 1)]
    assert comps[0].tolist() == sum((p for p, _ in pieces), []) and comps[1].tolist() == ids("\\boxed{1}") + eos
    assert masks[0].tolist() == sum(([m] * len(p) for p, m in pieces), []) and masks[1].tolist() == [1] * 10
    assert torch.equal(logps[0].isnan(), masks[0] == 0) and (logps[0][masks[0] == 1] == -0.5).all()
    assert truncated == [False, False] and prompts[0].tolist() == ids(prompt)
    assert [(c["arguments"]["expression"], c["result"], c.get("error", False)) for c in calls[0]] == [
        ("6*7", "42", False), ("2**10", "1024", False), ("1/0", "error: ZeroDivisionError: division by zero", True)]
    assert calls[1] == [] and [len(h) for h in held] == [2, 1, 1]
    assert held[1] == [ids(prompt) + sum((p for p, _ in pieces[:2]), [])]
    assert held[2] == [ids(prompt) + sum((p for p, _ in pieces[:4]), [])]


def test_t_counts_the_tools_tokens_and_max_tool_calls_ends_a_completion(tools_loaded, monkeypatch):
    """T counts every token after the prompt: a result that would pass it is cut at T (the row is truncated and
    draws no more); a turn whose calls would pass --max-tool-calls ends the completion, its calls counted (an error
    each), not run."""
    a, model, tok, tools = tools_loaded
    turns = [CALL.format("6*7"), CALL.format("2**10") + CALL.format("1/0"), "\\boxed{42}"]
    ids = lambda text: tok(text, add_special_tokens=False).input_ids  # noqa: E731
    first = len(ids(turns[0]) + ids(RESULTS.format(RESULT.format(42)))) + 1
    T = first + len(ids(turns[1])) + 1 + 5  # the second turn's results get 5 tokens
    for limit, want_len, cut, n_calls in ((8, T, True, 3), (2, T - 5, False, 3)):
        held = []
        monkeypatch.setattr(grpo, "sample", scripted(tok, [turns[:1], turns[1:2], turns[2:]], held))
        b = replace(a, max_new_tokens=T, max_tool_calls=limit)
        rows = grpo.generate(model, tok, [{"record": {"prompt": "q", "answer": "42"}}], b, tools=tools)
        comps, truncated, masks, calls = ([r[k] for r in rows] for k in ("completion", "truncated", "tool_mask",
                                                                          "tool_calls"))
        assert len(comps[0]) == want_len and truncated == [cut] and len(calls[0]) == n_calls and len(held) == 2
        assert masks[0][first + len(ids(turns[1])) + 1:].tolist() == [0] * (5 if cut else 0)
        assert [c["result"] for c in calls[0]][1:] == (["1024", "error: ZeroDivisionError: division by zero"] if cut
                                                       else ["error: past --max-tool-calls"] * 2)
    T = len(ids(turns[0])) + 1 + len(ids("\n<|im_start|>user" + RESULT.format(42) + "<|im_end|>"))  # cut at its EOS
    monkeypatch.setattr(grpo, "sample", scripted(tok, [turns[:1]]))
    row, = grpo.generate(model, tok, [{"record": {"prompt": "q", "answer": "42"}}], replace(a, max_new_tokens=T),
                         tools=tools)
    assert row["completion"][-1] == tok.eos_token_id and row["truncated"]  # the template's EOS, not the model's

@pytest.mark.parametrize("compiled", [False, True])
def test_the_sampler_draws_on_after_tool_results_as_the_trainer_reads_them(tools_loaded, compiled, monkeypatch):
    """Every row's first turn calls the calculator (scripted); the real sampler draws the next turn after the
    prompt, the call and its result, plain or compiled (one shape: the prompt length then covers a prompt and
    T): its log-probs are the trainer's, read through collate from the whole completion."""
    a, model, tok, tools = tools_loaded
    a = replace(a, max_new_tokens=180)
    model = copy.deepcopy(model)
    texts = [grpo.chat_prompt(tok, t, a.system_prompt, tools) for t in TEXTS]  # as generate renders them
    first_turn = [len(tok(t, add_special_tokens=False).input_ids) for t in texts]
    real, first = grpo.sample, scripted(tok, [[CALL.format("6*7")] * 8], logp=math.nan)  # (no sampler's)
    monkeypatch.setattr(grpo, "sample", lambda *args: (first if len(args[2][0]) in first_turn else real)(*args))
    sampler = grpo.make_sampler(model, a, max(first_turn) + a.max_new_tokens, 8, True) if compiled else None
    torch.manual_seed(0)
    rows = grpo.generate(model, tok, [{"record": {"prompt": t, "answer": ""}} for t in TEXTS for _ in range(4)], a,
                         sampler=sampler, tools=tools)
    logps, masks, calls = ([r[k] for r in rows] for k in ("logp", "tool_mask", "tool_calls"))
    assert all(len(c) == 1 for c in calls) and all(m[-1] == 1 and (m == 0).any() for m in masks)
    logp, mask = trainer_logps(model, tok, a, rows)
    drawn = (padded(masks, mask) == 1) & padded(logps, mask).isfinite() & (mask == 1)  # the real sampler's
    assert drawn.sum() > 100 and (logp - padded(logps, mask))[drawn].abs().max() < 1e-4


TOOLS_FILE = '''import ctypes, os, sys, time
def add(a: int, b: int) -> int:
    """Adds two numbers, printing and leaving a file where it runs.

    Args:
        a: a number
        b: another
    """
    print("noise")
    os.write(1, b"raw noise\\n")
    os.write(2, b"raw errors\\n")
    open("left.txt", "w").write("x")
    os.chdir("/")
    return a + b
def boom() -> str:
    """Raises."""
    raise ValueError("no")
def hang() -> str:
    """Never returns."""
    time.sleep(10000)
def die() -> str:
    """Ends its process."""
    os._exit(3)
def crash() -> str:
    """Crashes its process."""
    ctypes.string_at(0)
def big() -> str:
    """A megabyte."""
    return "x" * 2 ** 20 + "\\ud800"
def ask() -> str:
    """Reads its standard input."""
    return repr(sys.stdin.read())
def _helper():
    pass
'''


def test_every_failure_of_a_tool_is_a_result_and_nothing_it_does_touches_the_run(tools_dir, tmp_path, capfd):
    """The tools run in a process of their own, in a directory of its own, their output discarded: a print, a
    file left behind or a chdir reach neither the run's output nor its working directory. A tool that raises, one
    that is not there, arguments that are not a JSON object or not its own, a crash (os._exit, a segfault) and a
    timeout are each a result the model reads ("error: ..."); the process starts again after the last two; a
    megabyte comes back whole (a lone surrogate as '?') and is cut to what T leaves when rendered."""
    (tmp_path / "t.py").write_text(TOOLS_FILE)
    a = grpo.parse_args(["--model", tools_dir, "--tools", f"{tmp_path}/t.py", "--tool-timeout", "120"])
    tok = grpo.load_model(a, torch.device("cpu"))[1]
    tools = grpo.load_tools(a, tok)
    assert tools["names"] == ["add", "boom", "hang", "die", "crash", "big", "ask"]  # every public function

    def call(name, arguments=None):
        return grpo.run_tool(tools, {"name": name, "arguments": arguments or {}})
    here = os.getcwd()
    assert call("add", {"a": 2, "b": 3}) == {"name": "add", "arguments": {"a": 2, "b": 3}, "result": "5"}
    assert os.getcwd() == here and not os.path.exists("left.txt") and "noise" not in "".join(capfd.readouterr())
    assert os.path.exists(os.path.join(tools["dir"].name, "left.txt"))
    assert call("boom") == {"name": "boom", "arguments": {}, "result": "error: ValueError: no", "error": True}
    no_such = "error: call one of ['add', 'boom', 'hang', 'die', 'crash', 'big', 'ask'] with a JSON object"
    assert call("_helper")["result"] == call("open")["result"] == no_such and call("open")["error"]
    bad_json = grpo.parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>')[0]
    assert grpo.run_tool(tools, bad_json)["result"] == call("add", [1, 2])["result"] == no_such
    assert call("add", {"c": 1})["result"].startswith("error: TypeError: ")
    assert call("ask")["result"] == "''" and call("add", {"a": 1, "b": 0})["result"] == "1"  # (not the next call)
    pid = tools["proc"].pid
    assert call("die") == {"name": "die", "arguments": {}, "result": "error: its process was ended (exit code 3)",
                           "error": True, "timeout": False}
    assert call("add", {"a": 1, "b": 1})["result"] == "2" and tools["proc"].pid != pid  # started again
    assert call("crash")["result"] == f"error: its process was ended (exit code {-signal.SIGSEGV})"
    tools["timeout"] = 1
    assert call("hang") == {"name": "hang", "arguments": {}, "result": "error: its process was ended (ran past "
                            "--tool-timeout 1 s)", "error": True, "timeout": True}
    tools["timeout"] = 120
    assert call("add", {"a": 1, "b": 2})["result"] == "3"
    result = call("big")
    assert result["result"] == "x" * 2 ** 20 + "?" and "error" not in result
    cut = grpo.tool_turn(tok, [tok.eos_token_id], [result], 50)  # what T leaves: the row ends there
    assert cut == tok(RESULTS.format(RESULT.format("x" * 400)), add_special_tokens=False).input_ids[:50]


def test_a_run_that_ends_while_a_tool_hangs_leaves_no_process_behind(tools_dir, tmp_path):
    """The tools' process, and the child a tool forked, are killed as the trainer's ends (a stop, an error): one
    hanging in a tool is not left running forever."""
    (tmp_path / "t.py").write_text(TOOLS_FILE.replace("time.sleep(10000)", "open('hanging', 'w').close()\n"
                                                      "    time.sleep(10000)") + PROCS_FILE)
    script = f"""import os, pathlib, sys, threading, time
sys.path.insert(0, {HERE!r})
import grpo, torch
a = grpo.parse_args(["--model", {tools_dir!r}, "--tools", "{tmp_path}/t.py", "--tool-timeout", "600"])
tools = grpo.load_tools(a, grpo.load_model(a, torch.device("cpu"))[1])
assert grpo.run_tool(tools, {{"name": "fork", "arguments": {{"then": 0}}}})["result"] == "forked"
threading.Thread(target=grpo.run_tool, args=(tools, {{"name": "hang", "arguments": {{}}}}), daemon=True).start()
while not os.path.exists(os.path.join(tools["dir"].name, "hanging")):
    time.sleep(0.05)
print(pathlib.Path(tools["dir"].name, "pids").read_text(), flush=True)
"""
    pids = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600).stdout
    (tmp_path / "pids").write_text(pids)
    assert len(pids.split()) == 2 and live(tmp_path) == []


PROCS_FILE = '''import os, subprocess, threading, time
def _note(*pids):  # every process a tool runs in or starts, in its directory's "pids"
    with open("pids", "a") as f:
        f.write("".join(f"{p}\\n" for p in pids))
def sleeper() -> str:
    """Starts `sleep 300` and waits for it."""
    p = subprocess.Popen(["sleep", "300"])
    _note(os.getpid(), p.pid)
    return str(p.wait())
def fork(then: int) -> str:
    """Forks a child that sleeps, holding the worker's pipes, then returns (0) or ends its process (then).

    Args:
        then: 0, or an exit code
    """
    child = os.fork()
    if child == 0:
        time.sleep(300)
    _note(os.getpid(), child)
    if then:
        os._exit(then)
    return "forked"
def leave() -> str:
    """Ends its process just after its reply."""
    threading.Timer(0.2, os._exit, (5,)).start()
    return "bye"
'''


def live(folder, wait: float = 10.0) -> list[int]:
    """The processes a tools file noted (PROCS_FILE) still running after `wait` s at most (a SIGKILL lands in a
    moment; a zombie, reaped by no one here, is not running)."""
    def running(pid):
        try:
            return pathlib.Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
        except FileNotFoundError:
            return False
    pids = [int(pid) for pid in pathlib.Path(folder, "pids").read_text().split()]
    deadline = time.time() + wait
    while any(map(running, pids)) and time.time() < deadline:
        time.sleep(0.05)
    return [pid for pid in pids if running(pid)]


def test_nothing_a_tool_starts_outlives_a_timeout_a_crash_or_a_restart(tools_dir, tmp_path):
    """The tools' process runs in a process group of its own, and every end of it ends the group: a timeout (the
    `sleep` a tool started goes too), a crash while a child it forked holds its pipe (still the crash it was, not
    a timeout), and a restart after it ended by itself (its forked child goes as the new one starts)."""
    (tmp_path / "t.py").write_text(PROCS_FILE)
    a = grpo.parse_args(["--model", tools_dir, "--tools", f"{tmp_path}/t.py", "--tool-timeout", "1"])
    tools = grpo.load_tools(a, grpo.load_model(a, torch.device("cpu"))[1])
    folder = tools["dir"].name

    def call(name, **arguments):
        return grpo.run_tool(tools, {"name": name, "arguments": arguments})
    assert call("sleeper") == {"name": "sleeper", "arguments": {}, "error": True, "timeout": True,
                               "result": "error: its process was ended (ran past --tool-timeout 1 s)"}
    assert len(pathlib.Path(folder, "pids").read_text().split()) == 2 and live(folder) == []
    assert call("fork", then=3) == {"name": "fork", "arguments": {"then": 3}, "error": True, "timeout": False,
                                    "result": "error: its process was ended (exit code 3)"}
    assert live(folder) == []
    assert call("fork", then=0)["result"] == "forked" and call("leave")["result"] == "bye"
    pid = tools["proc"].pid
    while tools["proc"].poll() is None:  # it ends; the child it forked runs on, till the next call
        time.sleep(0.05)
    assert len(live(folder, wait=0)) == 1
    assert call("fork", then=0)["result"] == "forked" and tools["proc"].pid != pid
    grpo.end_worker(tools)  # as the run ends (atexit)
    assert live(folder) == [] and tools["proc"] is None


def test_a_tools_process_that_ends_after_its_reply_is_that_call_s_error_not_the_run_s(tools_dir, tmp_path):
    """Seen alive, gone by the time the next call is written (a broken pipe): the call's result says its process
    ended, and the next call starts a new one."""
    (tmp_path / "t.py").write_text(PROCS_FILE)
    a = grpo.parse_args(["--model", tools_dir, "--tools", f"{tmp_path}/t.py"])
    tools = grpo.load_tools(a, grpo.load_model(a, torch.device("cpu"))[1])
    assert grpo.run_tool(tools, {"name": "leave", "arguments": {}})["result"] == "bye"
    proc = tools["proc"]
    stat = pathlib.Path(f"/proc/{proc.pid}/stat")
    while stat.read_text().split(") ")[1][0] != "Z":  # ended, not yet reaped
        time.sleep(0.05)
    proc.poll = lambda: None  # as if it were seen alive an instant before
    assert grpo.run_tool(tools, {"name": "fork", "arguments": {"then": 0}}) == {
        "name": "fork", "arguments": {"then": 0}, "result": "error: its process was ended (exit code 5)",
        "error": True, "timeout": False}
    assert grpo.run_tool(tools, {"name": "fork", "arguments": {"then": 0}})["result"] == "forked"
    grpo.end_worker(tools)
    assert live(tools["dir"].name) == []


@pytest.mark.parametrize("body, spec, says", [
    ("def f(x: int) -> int:\n    return (x\n", "", "SyntaxError"),
    ("import no_such_module\n", "", "ModuleNotFoundError: No module named 'no_such_module'"),
    ("def f(x: int) -> int:\n    return x\n", "", "DocstringParsingException"),  # no docstring: no schema
    ("def f(x):\n    '''F.\n\n    Args:\n        x: x\n    '''\n", "", "TypeHintParsingException"),
    (TOOLS_FILE, ":add,nope", "no public function 'nope'"), ("import sys\nsys.exit(3)\n", "", "SystemExit: 3"),
    ("X = 1\n", "", "no public function ''"), (TOOLS_FILE, ":add", "shows no tool"),
    (TOOLS_FILE, ":", "no public function ''"), (TOOLS_FILE, ":add,", "no public function ''"),
    (TOOLS_FILE, ":_helper", "no public function '_helper'"),
    ("def f(*xs: int) -> int:\n    '''F.\n\n    Args:\n        xs: numbers\n    '''\n", "", r"no \*args"),
    ("def f(**kw: int) -> int:\n    '''F.\n\n    Args:\n        kw: numbers\n    '''\n", "", r"no \*args")])
def test_a_tools_file_that_cannot_serve_stops_the_run_at_start_in_one_line(tiny_dir, tools_dir, tmp_path, body,
                                                                           spec, says):
    (tmp_path / "t.py").write_text(body)
    model = tiny_dir if says == "shows no tool" else tools_dir  # tiny's default template shows no tools
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=f"^grpo: error: --tools '{tmp_path}/t.py{spec}': .*{says}"):
        main(["--model", model, "--output-dir", str(out), "--tools", f"{tmp_path}/t.py{spec}"] + TINY)
    assert not out.exists()  # before anything is written


SLOW_IMPORT = '''import time
time.sleep(2)  # as a file that imports torch or sympy
async def add(a: int, b: int) -> int:
    """Adds, awaited.

    Args:
        a: a number
        b: another
    """
    return a + b
'''


def test_a_tools_file_s_import_is_no_call_s_time_and_an_async_tool_is_awaited(tools_dir, tmp_path):
    """The tools' process says it is ready once the file is imported: a 2 s import with --tool-timeout 1 times no
    call out; an `async def` tool's result is its value, not a coroutine's repr."""
    (tmp_path / "t.py").write_text(SLOW_IMPORT)
    a = grpo.parse_args(["--model", tools_dir, "--tools", f"{tmp_path}/t.py", "--tool-timeout", "1"])
    tools = grpo.load_tools(a, grpo.load_model(a, torch.device("cpu"))[1])
    assert grpo.run_tool(tools, {"name": "add", "arguments": {"a": 2, "b": 3}}) == {
        "name": "add", "arguments": {"a": 2, "b": 3}, "result": "5"}
    grpo.end_worker(tools)


@pytest.mark.parametrize("value", ["1e300", "inf", "1e7"])
def test_a_tool_timeout_past_a_million_seconds_is_refused_in_one_line(value):
    with pytest.raises(SystemExit, match=r"^grpo: error: --tool-timeout must be in \(0, 1e6\], not "):
        grpo.parse_args(["--tools", "calculator", "--tool-timeout", value])


def test_the_prompt_length_check_renders_one_prompt_at_a_time(tools_loaded, monkeypatch):
    """Every prompt holds the tools' schemas (a 460 KB docstring: every built-in prompt with it at once is killed
    for memory): longest_prompt tokenizes them one at a time, and finds the longest as before."""
    a, model, tok, tools = tools_loaded
    train = [{"prompt": "x " * k, "answer": "1"} for k in range(40)]
    sizes, real = [], type(tok).__call__

    def counting(self, text, *args, **kw):
        sizes.append(1 if isinstance(text, str) else len(text))
        return real(self, text, *args, **kw)
    monkeypatch.setattr(type(tok), "__call__", counting)
    longest = grpo.longest_prompt(model, tok, a, train, [], True, tools)
    assert len(sizes) == 40 and max(sizes) == 1
    assert longest == len(real(tok, grpo.prompt_text(tok, train[-1], a, tools), add_special_tokens=False).input_ids)


ENV_FILE = '''import os
class Guess:
    """Find a number: each guess is answered higher, lower or right."""
    def __init__(self):
        self.guesses = 0
        self.done = False
    def reset(self, seed: int = 7, **record) -> str:
        if seed < 0:
            raise ValueError("no game for a negative seed")
        self.target = seed
        return " (1..100)"
    def guess(self, n: int) -> str:
        """Guesses the number; -1 ends the process.

        Args:
            n: a number in 1..100
        """
        if n == -1:
            os._exit(9)
        self.guesses += 1
        self.done = n == self.target
        return "right" if self.done else "higher" if n < self.target else "lower"
    async def peek(self) -> int:
        """The number, awaited."""
        return self.target
    def _helper(self):
        pass
class Broken:
    def __init__(self):
        raise RuntimeError("cannot start")
    def reset(self, **record):
        pass
    def ping(self) -> str:
        """Answers."""
        return "pong"
'''
GUESS = '<tool_call>\n{{"name": "guess", "arguments": {{"n": {}}}}}\n</tool_call>'


@pytest.fixture()
def env_loaded(tools_dir, tmp_path):
    (tmp_path / "g.py").write_text(ENV_FILE)
    a = grpo.parse_args(["--model", tools_dir, "--env", f"{tmp_path}/g.py:Guess", "--max-new-tokens", "400"])
    model, tok = grpo.load_model(a, torch.device("cpu"))[:2]
    tools = grpo.load_tools(a, tok, [{"prompt": "p", "answer": "1", "seed": 30}])
    yield a, model, tok, tools
    grpo.end_worker(tools)


def test_an_environment_is_an_instance_a_completion_reset_with_its_record(env_loaded, monkeypatch):
    """--env PATH.py:Class (TRL's environment_factory): each completion's own instance, reset(**record) first (its
    text ends the prompt's user turn), its public typed documented methods the tools (async ones awaited); the
    episode ends when a method sets done, or with a turn that makes no call; a crash ends the process and its
    instance is rebuilt from its record for the next call (its state gone); each row's episode gets its
    instance's public attributes (a reward's env)."""
    a, model, tok, tools = env_loaded
    assert tools["names"] == ["guess", "peek"] and [s["function"]["name"] for s in tools["schemas"]] == tools["names"]
    script = [[GUESS.format(50), GUESS.format(30), "no call", GUESS.format(50)],
              [GUESS.format(30), GUESS.format(-1)], [GUESS.format(60)]]
    held = []
    monkeypatch.setattr(grpo, "sample", scripted(tok, script, held))
    records = [{"prompt": "Guess.", "answer": "30", "seed": 30}, {"prompt": "Again.", "answer": "60", "seed": 60}]
    episodes = grpo.generate(model, tok, [{"record": r} for r in records for _ in range(2)], a, tools=tools)
    prompts, truncated, masks, calls = ([e[k] for e in episodes] for k in ("prompt_ids", "truncated", "tool_mask",
                                                                            "tool_calls"))
    assert prompts[0].tolist() == tok(grpo.chat_prompt(tok, "Guess. (1..100)", a.system_prompt, tools),
                                      add_special_tokens=False).input_ids
    assert [[c["result"] for c in row] for row in calls] == [
        ["lower", "right"], ["right"], [], ["higher", "error: its process was ended (exit code 9)", "right"]]
    assert [c.get("done", False) for row in calls for c in row] == [False, True, True, False, False, True]
    assert [len(h) for h in held] == [4, 2, 1]  # done rows draw no more; the crash's row draws on
    assert [e["env"] for e in episodes] == [{"guesses": 2, "done": True, "target": 30},
                                            {"guesses": 1, "done": True, "target": 30},
                                            {"guesses": 0, "done": False, "target": 60},
                                            {"guesses": 1, "done": True, "target": 60}]  # (rebuilt: 1 guess)
    assert truncated == [False] * 4 and all(m[-1] == 1 for m in masks)  # each ends with the model's turn
    assert grpo.run_tool(tools, {"name": "peek", "arguments": {}}, 2, episodes[2])["result"] == "60"
    seen = []

    def reward(completion, answer, env, tool_calls, **kw):
        seen.append((env.guesses, env.done, len(tool_calls)))
        env.guesses = 99  # a copy: nothing to undo
        return float(env.done)
    total = grpo.score([dict(e, text="a", completion=[0]) for e in episodes], [("won", reward, 1.0)], a)[0]
    assert total.tolist() == [1, 1, 0, 1] and seen == [(2, True, 2), (1, True, 1), (0, False, 0), (1, True, 3)]
    assert episodes[0]["env"]["guesses"] == 2


NEIGHBOUR_FILES = {"helpers.py": "def double(x):\n    return 2 * x\n", "env.py": '''from helpers import double
class Base:
    def reset(self, **record):
        self.total = 0
    def add(self, k: int) -> str:
        """Adds twice k to the total.

        Args:
            k: the number
        """
        self.total += double(k)
        return str(self.total)
class Child(Base):
    pass
''', "tools.py": '''from helpers import double
def twice(x: int) -> int:
    """Twice x.

    Args:
        x: the number
    """
    return double(x)
''', "rw.py": "from helpers import double\ndef r(completion, answer, **kw):\n    return double(0.5)\n"}


def test_a_file_imports_the_modules_beside_it_and_an_environment_offers_its_inherited_methods(tools_dir, tmp_path):
    """A tools, environment or reward file that imports a module beside it loads in the trainer as in the tools'
    process (its folder importable, as `python FILE` has it); an --env class's methods include those it inherits
    (a subclass of an environment is an environment); --tools and --env together are refused at once."""
    for name, text in NEIGHBOUR_FILES.items():
        (tmp_path / name).write_text(text)
    a = grpo.parse_args(["--model", tools_dir, "--reward-fn", f"{tmp_path}/rw.py:r"])
    assert [(name, fn("", "")) for name, fn, _ in grpo.build_rewards(a)] == [("r", 1.0)]
    tok = grpo.load_model(grpo.parse_args(["--model", tools_dir]), torch.device("cpu"))[1]
    for flags, call, result in ((["--env", f"{tmp_path}/env.py:Child"], "add", "4"),
                                (["--tools", f"{tmp_path}/tools.py"], "twice", "4")):
        a = grpo.parse_args(["--model", tools_dir] + flags)
        tools = grpo.load_tools(a, tok, [{"prompt": "p", "answer": "1"}])
        try:
            assert tools["names"] == [call]
            row = {"record": {"prompt": "p", "answer": "1"}}
            grpo.run_tool(tools, {"name": "reset"}, 0, row)
            assert grpo.run_tool(tools, {"name": call, "arguments": {"k" if a.env else "x": 2}}, 0, row)["result"] \
                == result
        finally:
            grpo.end_worker(tools)
    with pytest.raises(SystemExit, match="^grpo: error: --tools and --env: give one"):
        grpo.parse_args(["--model", tools_dir, "--tools", "calculator", "--env", f"{tmp_path}/env.py:Child"])


def test_an_environment_that_fails_for_one_record_is_that_episode_s_error(tools_dir, tmp_path, monkeypatch):
    """reset raising for one record, or __init__ raising: the error is what that episode's model reads (after its
    prompt), its calls fail alike, and the run goes on; the other records' episodes play."""
    (tmp_path / "g.py").write_text(ENV_FILE)
    for cls, results in (("Guess", [["higher"], ["error: ValueError: no game for a negative seed"]]),
                         ("Broken", [["error: RuntimeError: cannot start"]] * 2)):
        a = grpo.parse_args(["--model", tools_dir, "--env", f"{tmp_path}/g.py:{cls}", "--max-new-tokens", "300"])
        model, tok = grpo.load_model(a, torch.device("cpu"))[:2]
        tools = grpo.load_tools(a, tok)
        call = GUESS.format(50) if cls == "Guess" else '<tool_call>{"name": "ping", "arguments": {}}</tool_call>'
        monkeypatch.setattr(grpo, "sample", scripted(tok, [[call, call], ["done", "done"]]))
        episodes = [{"record": {"prompt": "Go.", "answer": "1", "seed": s}} for s in (60, -1)]
        grpo.generate(model, tok, episodes, a, tools=tools)
        assert [[c["result"] for c in e["tool_calls"]] for e in episodes] == results
        said = tok.decode(episodes[1]["prompt_ids"])
        assert results[1][0] in said  # (in its prompt: reset's text is the error)
        grpo.end_worker(tools)


@pytest.mark.parametrize("body, spec, records, says", [
    (ENV_FILE, ":Nope", [], "no class 'Nope' with a reset"),
    (ENV_FILE, "", [], r"no class '' with a reset\(self, \*\*record\): --env PATH.py:Class$"),
    ("class G:\n    def play(self) -> str:\n        '''Plays.'''\n", ":G", [], "no class 'G' with a reset"),
    ("class G:\n    def reset(self, **r):\n        pass\n    def play(self) -> str:\n        return ''\n", ":G", [],
     "DocstringParsingException"),
    ("class G:\n    def reset(self, **r):\n        pass\n", ":G", [], "no public function ''"),
    (ENV_FILE, ":Guess", [{"prompt": "p", "answer": "1", "when": {1, 2}}], "TypeError: Object of type set is not JSON"),
])
def test_an_environment_that_cannot_serve_stops_the_run_at_start_in_one_line(tools_dir, tmp_path, body, spec,
                                                                             records, says):
    (tmp_path / "g.py").write_text(body)
    a = grpo.parse_args(["--model", tools_dir, "--env", f"{tmp_path}/g.py{spec}"])
    tok = grpo.load_model(a, torch.device("cpu"))[1]
    with pytest.raises(SystemExit, match=f"^grpo: error: --env '{tmp_path}/g.py{spec}': .*{says}"):
        grpo.load_tools(a, tok, records)


def test_the_guessing_game_s_warm_start_plays_as_grpo_s_loop_renders_it(tools_dir, monkeypatch):
    """bench/learn_env.py (python bench/learn_env.py --smoke runs every part in a minute): binary search on the
    replies wins every game within 7 guesses; a transcript is the model's call turns and the environment's replies
    between them as grpo.generate renders them (mask 0 on the replies), ending at the win, with the number its
    record's seed draws (bench/guess_env.py)."""
    sys.path.insert(0, os.path.join(HERE, "bench"))
    import learn_env
    assert all(play[-1][1] == "right" and len(play) <= 7 for play in (
        learn_env.play(n, True, None) for n in range(1, 101)))
    ex = learn_env.games(1, 0)[0]
    a = grpo.parse_args(["--model", tools_dir, "--env", f"{learn_env.GAME}:Guess", "--system-prompt", ""])
    model, tok = grpo.load_model(a, torch.device("cpu"))[:2]
    tools = grpo.load_tools(a, tok, [ex])
    prompt, ids, mask = learn_env.transcript(tok, tools, ex, True, "", None)
    turns = [GUESS.format(n) for n, _ in learn_env.play(int(ex["answer"]), True, None)]
    monkeypatch.setattr(grpo, "sample", scripted(tok, [[t] for t in turns]))
    episodes = grpo.generate(model, tok, [{"record": ex}], replace(a, max_new_tokens=400), tools=tools)
    grpo.end_worker(tools)
    comps, masks, calls = ([e[k] for e in episodes] for k in ("completion", "tool_mask", "tool_calls"))
    assert comps[0].tolist() == ids and masks[0].tolist() == mask and calls[0][-1]["result"] == "right"
    assert prompt == grpo.chat_prompt(tok, ex["prompt"], "", tools) and episodes[0]["env"]["won"]


def test_the_tiny_model_s_tools_template_renders_as_qwen2_5_s(tools_loaded):
    """tiny.TOOLS_CHAT_TEMPLATE against Qwen2.5-Instruct's rendering, written out: its default system message
    when none is given, the # Tools block with one JSON schema a line, an assistant turn's calls, and results as
    one user turn of <tool_response>s; the tools' prompt is the one chat_prompt builds."""
    tok, tools = tools_loaded[2], tools_loaded[3]
    schema = json.dumps(tools["schemas"][0], ensure_ascii=False)
    assert grpo.chat_prompt(tok, "Hi", "", tools) == (
        f"<|im_start|>system\n{tiny.QWEN_SYSTEM}\n\n# Tools\n\nYou may call one or more functions to assist with "
        "the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{schema}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
        'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "6*7"}}},
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1"}}}]},
            {"role": "tool", "content": "42"}, {"role": "tool", "content": "1"}, {"role": "assistant", "content": "A"}]
    assert tok.apply_chat_template(chat, tokenize=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n" + CALL.format("6*7")
        + "\n" + CALL.format("1") + "<|im_end|>" + RESULTS.format(RESULT.format(42) + RESULT.format(1))
        + "A<|im_end|>\n")
    assert tiny.make_tokenizer().apply_chat_template(chat[:2], tokenize=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n")  # the default template, unchanged

@pytest.mark.parametrize("agg", grpo.LOSS_AGGS)
def test_a_step_trains_the_model_s_tokens_alone_and_counts_them_alone(loaded, agg):
    """train_step's update (SGD, lr 1) with tool tokens in the completions (every third token from the second, as
    each row's tool_mask says) equals the gradient by hand with a mask written out here: no loss and no KL there,
    and |o_i| and both normalisers count the model's tokens alone (Dr. GRPO's T stays T); it differs from the
    update that trains them too."""
    a, model, tok = loaded
    a = replace(a, loss_agg=agg, max_grad_norm=0.0, max_new_tokens=6, scale="std", micro_batch_size=3, beta=0.04,
                tools="calculator")
    groups = tiny.fixed_groups(tok, REWARDS, a)
    for row in groups:
        row["tool_mask"] = torch.tensor([float(j % 3 != 1) for j in range(len(row["completion"]))])
    batch = {**grpo.collate(groups, tok.pad_token_id, "cpu"), "adv": adv_rows(groups, a)}
    lengths = [len(row["completion"]) for row in groups]
    mask = torch.tensor([[float(j < n and j % 3 != 1) for j in range(max(lengths))] for n in lengths])
    assert torch.equal(batch["mask"], mask) and (mask.sum(1) < torch.tensor(lengths)).sum() > 8
    update, _ = sgd_update(model, a, groups, tok.pad_token_id)
    assert_same_update(update, hand_update(model, {**batch, "mask": mask}, agg, 6, beta=0.04))
    everything = torch.tensor([[float(j < n) for j in range(max(lengths))] for n in lengths])
    every = hand_update(model, {**batch, "mask": everything}, agg, 6, beta=0.04)
    assert not all(torch.allclose(every[n], v, rtol=1e-3) for n, v in update.items())


def test_the_reward_grades_the_model_s_text_and_gets_its_length_and_its_calls(tools_loaded, monkeypatch, tmp_path):
    """rollout with tools: a reward grades what the model wrote (its tokens, not a result's: a call of 6*7 and no
    answer is not 42), gets `length` (every token after the prompt, as T counts them) and `tool_calls` (each call,
    its result); the step's tools/ metrics are over every completion, and samples.jsonl has each row's calls."""
    a, model, tok, tools = tools_loaded
    a = replace(a, max_new_tokens=400, prompts_per_step=1, num_generations=4)
    script = [[CALL.format("6*7"), CALL.format("1/0") + CALL.format("2"), "\\boxed{3}", CALL.format("40+2")],
              ["\\boxed{42}", "\\boxed{2}", ""]]
    monkeypatch.setattr(grpo, "sample", scripted(tok, script))
    seen = []

    def judge(text, answer, length, tool_calls, **kw):
        seen.append((text, length, [c["result"] for c in tool_calls]))
        return float(len(tool_calls))
    stream = grpo.prompt_stream([{"prompt": "What is 6*7?", "answer": "42"}], 0)
    _, m, generated = grpo.rollout(model, tok, stream, [("judge", judge, 1.0)], None, a, {"prompts_drawn": 0}, tools=tools)
    comps = [r["completion"] for r in generated]
    results = [["42"], ["error: ZeroDivisionError: division by zero", "2"], [], ["42"]]
    assert seen == [(r["text"], len(c), res) for r, c, res in zip(generated, comps, results)]
    assert [t for t, _, _ in seen] == [CALL.format("6*7") + "\\boxed{42}", CALL.format("1/0") + CALL.format("2") +
                                       "\\boxed{2}", "\\boxed{3}", CALL.format("40+2")]  # no result's text
    assert "<tool_response>\n42\n</tool_response>" in tok.decode(comps[0], skip_special_tokens=True)  # (it holds)
    assert [r["reward"] for r in generated] == [1, 2, 0, 1]
    assert m["accuracy"] == 1 / 4 and m["tools/calls"] == 4 / 4 and m["tools/call_frac"] == 3 / 4  # the last: not 42
    assert m["tools/errors"] == 1 / 4 and m["tools/timeouts"] == 0  # 1/0 raised
    rows = grpo.sample_rows(generated, 1)
    assert [[c["result"] for c in r["tool_calls"]] for r in rows] == results
    assert [r["completion"] for r in rows] == [t for t, _, _ in seen]

def forced_calls(tok, every=2):
    """grpo.sample, but every other row's first turn is a calculator call (its log-probs NaN: not the sampler's):
    a random tiny model calls tools in a real run. A first turn holds a prompt alone (no <|im_start|>assistant
    after the last <|im_start|>user)."""
    real = grpo.sample
    call = tok(CALL.format("17*23"), add_special_tokens=False).input_ids + [tok.eos_token_id]

    def sample(model, tok_, held, new_tokens, a, greedy=False, sampler=None, temps=None):
        drawn, logp = real(model, tok_, held, new_tokens, a, greedy, sampler, temps)
        drawn = torch.cat([drawn, torch.full((len(drawn), len(call)), tok.pad_token_id)], 1)
        logp = torch.cat([logp, torch.zeros(len(drawn), len(call))], 1)
        for r, h in enumerate(held):
            if r % every == 0 and "<tool_response>" not in tok.decode(h):
                drawn[r, :len(call)] = torch.tensor(call)
                logp[r, :len(call)] = math.nan
        return drawn, logp
    return sample


def test_resume_with_tools_continues_bit_for_bit(tools_dir, tmp_path, monkeypatch):
    """--tools calculator, every other row's first turn a call (forced), the rows drawing on after its result:
    4 steps == 2 steps, --resume to 4 (the metrics, tools/ among them, and the adapter, bit for bit); the calls
    and results are in samples.jsonl; tools/calls is what the rows called."""
    tok = grpo.load_model(grpo.parse_args(["--model", tools_dir]), torch.device("cpu"))[1]
    monkeypatch.setattr(grpo, "sample", forced_calls(tok))
    common = ["--model", tools_dir, "--tools", "calculator", "--log-samples", "1", "--eval-every", "0"] + TINY \
        + ["--max-new-tokens", "150"] + reward_file(tmp_path)
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    main(common + ["--output-dir", straight, "--max-steps", "4"])
    main(common + ["--output-dir", split, "--max-steps", "2"])
    main(["--output-dir", split, "--resume", "--max-steps", "4"])
    assert steady(metrics(split)) == steady(metrics(straight)) and len(metrics(split)) == 4
    assert [r["tools/calls"] for r in metrics(split)] == [0.5] * 4 and metrics(split)[0]["tools/errors"] == 0
    a, b = trained(straight), trained(split)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(r) for r in open(os.path.join(split, "samples.jsonl"))]
    assert [r["tool_calls"] for r in rows[:2]] == [[{"name": "calculator", "arguments": {"expression": "17*23"},
                                                     "result": "391"}], []]
    assert rows[0]["completion"].startswith(CALL.format("17*23")) and "391" not in rows[0]["completion"]  # (its own)


CALC_ENV = '''class Calc:
    def reset(self, prompt: str, **record) -> str:
        self.calls = 0
        return " Use the calculator."
    def calculator(self, expression: str) -> str:
        """Evaluates an expression, once: the episode ends with it.

        Args:
            expression: arithmetic
        """
        self.calls += 1
        self.done = True
        return str(eval(expression))
'''


def test_an_environment_run_resumes_bit_for_bit_and_logs_its_episodes(tools_dir, tmp_path, monkeypatch):
    """--env in a run, every other row's first turn a call (forced) that ends its episode (done), a reward that
    reads env, evaluation with it: 4 steps == 2 steps, --resume to 4 (metrics, env/ among them, and the adapter,
    bit for bit: instances are rebuilt from their records); env/done_frac is the share of rows that called."""
    (tmp_path / "calc.py").write_text(CALC_ENV)
    tok = grpo.load_model(grpo.parse_args(["--model", tools_dir]), torch.device("cpu"))[1]
    monkeypatch.setattr(grpo, "sample", forced_calls(tok))
    common = ["--model", tools_dir, "--env", f"{tmp_path}/calc.py:Calc", "--log-samples", "1"] + TINY + [
        "--max-new-tokens", "150"] + reward_file(tmp_path, "def used(c, a, env, **kw):\n    return env.calls + len(c) / 50\n")
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    main(common + ["--output-dir", straight, "--max-steps", "4"])
    main(common + ["--output-dir", split, "--max-steps", "2"])
    main(["--output-dir", split, "--resume", "--max-steps", "4"])
    assert steady(metrics(split)) == steady(metrics(straight)) and len(metrics(split)) == 4
    assert [(r["env/done_frac"], r["env/turns"], r["tools/calls"]) for r in metrics(split)] == [(0.5, 1, 0.5)] * 4
    assert "eval/accuracy" in metrics(split)[1]
    a, b = trained(straight), trained(split)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(r) for r in open(os.path.join(split, "samples.jsonl"))]
    assert rows[0]["tool_calls"] == [{"name": "calculator", "arguments": {"expression": "17*23"}, "result": "391",
                                      "done": True}] and rows[1]["tool_calls"] == []
    assert rows[0]["rewards"]["used"] == pytest.approx(1 + len(rows[0]["completion"]) / 50)  # (float32)


def test_dry_run_says_the_tool_mask(capsys):
    grpo.main(["--dry-run", "--tools", "calculator", "--max-tool-calls", "3", "--tool-timeout", "5"])
    assert ("Σ_t over m_i,t = 1 on the model's tokens to its last EOS, 0 on the results of ≤3 calls (≤5 s each) "
            "and the template's tokens around them\n") in capsys.readouterr().out

# ----------------------------------------------------------------------------- the compiled sampler
def trainer_logps(model, tok, a, rows):
    """The trainer's log-probs (and the sampler's, laid out alike) of generate()'s rows, through collate (mask 1 on
    every token of a completion, the tools' too)."""
    rows = [dict(r, tool_mask=torch.ones(len(r["completion"])), reward=0.0, rewards={}, order=0, is_teacher=False)
            for r in rows]
    b = grpo.collate(rows, tok.pad_token_id, "cpu")
    with torch.no_grad(), grpo.autocast(a, b["input_ids"].device):
        logp, _ = grpo.token_logps(model, b["input_ids"], b["attention_mask"], b["mask"].shape[1], a.temperature)
    return logp, b["mask"]


def padded(logps, mask):
    out = torch.zeros(mask.shape)
    for i, lp in enumerate(logps):
        out[i, :len(lp)] = lp
    return out


TEXTS = ["What is 2 + 3?", "Ava has 4 apples and gets 5 more. How many apples does Ava have now?"]


@pytest.mark.parametrize("dtype, atol", [("fp32", 1e-4), ("bf16", 0.05)])
def test_compiled_sampler_draws_what_the_uncompiled_one_draws(loaded, loaded_bf16, dtype, atol):
    """Same seed, same tokens, and the sampler's log-probs equal the trainer's. fp32: to float rounding (1e-4).
    bf16: the sampler's decode and the trainer's full forward round apart; a logit near 2 carries bf16's 2^-8
    relative error, about 0.01 each, and a log-prob a few of them: 0.05 at most, far below a stale weight's gap."""
    a, model, tok = loaded if dtype == "fp32" else loaded_bf16
    model = copy.deepcopy(model)
    records = [{"prompt": t, "answer": ""} for t in TEXTS for _ in range(a.num_generations)]
    torch.manual_seed(0)
    plain = grpo.generate(model, tok, [{"record": ex} for ex in records], a)
    sampler = grpo.make_sampler(model, a, 300, 8, compiled=True)
    torch.manual_seed(0)
    rows = grpo.generate(model, tok, [{"record": ex} for ex in records], a, sampler=sampler)
    same = [torch.equal(x["completion"], y["completion"]) for x, y in zip(plain, rows)]
    assert all(same) if dtype == "fp32" else sum(same) >= len(same) - 2, same  # bf16: a near-tie may flip a draw
    assert all(torch.equal(x["prompt_ids"], y["prompt_ids"]) for x, y in zip(plain, rows))
    assert [r["truncated"] for r in rows] == [r["truncated"] for r in plain]
    for sampled in (plain, rows):
        logp, mask = trainer_logps(model, tok, a, sampled)
        gap = (logp - padded([r["logp"] for r in sampled], mask)).abs() * mask
        assert gap.max() < atol, gap.max()


def test_compiled_sampler_reads_this_step_s_weights_and_compiles_once(loaded):
    """After an optimizer step the compiled sampler's log-probs are the trainer's at the NEW weights (a sampler
    reading stale weights fails this: the step moves them by far more than the tolerance), the parameters keep
    their storage, and sampling, greedy evaluation and a second step reuse the one compiled graph."""
    a, model, tok = loaded
    model = copy.deepcopy(model)
    a = replace(a, learning_rate=0.05)
    records = [{"prompt": t, "answer": ""} for t in TEXTS]
    sampler = grpo.make_sampler(model, a, 300, 8, compiled=True)
    opt = grpo.make_optimizer(a, model)
    ptrs = [p.data_ptr() for p in model.parameters()]
    rows = grpo.generate(model, tok, [{"record": ex} for ex in records for _ in range(4)], a, sampler=sampler)
    old = copy.deepcopy(model)
    with torch.compiler.set_stance("fail_on_recompile"):
        for step in range(2):
            for i, r in enumerate(rows):
                r.update(reward=[1.0, 0, 0, 1][i % 4], rewards={}, order=i // 4, is_teacher=False)
            m = grpo.train_step(model, None, opt, rows, a)
            assert m["sampler/logp_gap"] < 1e-4  # sampled at the weights the trainer starts the step from
            grpo.generate(model, tok, [{"record": records[0]}], a, greedy=True, sampler=sampler)  # evaluation's: same shape
            grpo.sample(model, tok, [rows[0]["prompt_ids"]], 3, a, sampler=sampler)  # a tool turn's: fewer rows, tokens
            rows = grpo.generate(model, tok, [{"record": ex} for ex in records for _ in range(4)], a, sampler=sampler)
            now, mask = trainer_logps(model, tok, a, rows)
            stale, _ = trainer_logps(old, tok, a, rows)
            drawn = padded([r["logp"] for r in rows], mask)
            assert ((now - drawn).abs() * mask).max() < 1e-4
            assert ((stale - drawn).abs() * mask).max() > 0.05  # what a stale sampler would show
            old = copy.deepcopy(model)
    assert [p.data_ptr() for p in model.parameters()] == ptrs  # updated in place, never swapped


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_the_sampler_draws_at_its_temperature(loaded, temperature):
    """Tokens drawn from π_T = softmax(logits / T) have E[log π_T(x_t)] = -H(π_T) at every position, so
    d_t = log π_T(x_t) + H_t (the trainer's tempered log-prob and entropy there) averages 0, to within a few
    standard errors over some 380 draws (measured: |z| < 0.3). Drawn at T = 1 and recorded at T (the gap metric
    then 0), d_t averages -KL(π_1 || π_T) - H(π_1) + H(π_T): z = -34 at T = 0.5, +7 at T = 2 (measured)."""
    a, model, tok = loaded
    model = copy.deepcopy(model)
    with torch.no_grad():  # logits 3 times a random tiny model's (tied to the input embeddings): the temperature
        model.get_output_embeddings().weight.mul_(3.0)  # shows (entropy 1.2 nats at T = 0.5, 5.5 at T = 2)
    a = replace(a, temperature=temperature)
    torch.manual_seed(0)
    rows = grpo.generate(model, tok, [{"record": {"prompt": t, "answer": ""}} for t in TEXTS for _ in range(16)], a)
    for i, r in enumerate(rows):
        r.update(reward=0.0, rewards={}, order=i // 16, is_teacher=False)
    b = grpo.collate(rows, tok.pad_token_id, "cpu")
    with torch.no_grad():
        logp, entropy = grpo.token_logps(model, b["input_ids"], b["attention_mask"], b["mask"].shape[1], temperature)
    d = (logp + entropy)[b["mask"].bool()]
    z = d.mean() / (d.std() / len(d) ** 0.5)
    assert len(d) > 300 and abs(z) < 4, (len(d), z)


def test_tis_weights_each_token_by_the_truncated_ratio(loaded):
    """With sampler = trainer - log 2 at every token, pi_old / pi_sampler = 2: --tis 1.5 scales the whole
    update by 1.5, --tis 3 by 2; teacher rows (no sampler log-prob) keep weight 1."""
    a, model, tok = loaded
    a = replace(a, max_grad_norm=0.0, micro_batch_size=16)
    groups = tiny.fixed_groups(tok, [[1.0, 0.0, 0.5, 0.2], [0.0, 1.0, 1.0, 0.3]], a)
    b = grpo.collate(groups, tok.pad_token_id, "cpu")
    with torch.no_grad():
        logp, _ = grpo.token_logps(model, b["input_ids"], b["attention_mask"], b["mask"].shape[1])
    for row, lp in zip(groups, logp):
        row["logp"] = lp[:len(row["completion"])] - math.log(2)
    base, _ = sgd_update(model, a, tiny.fixed_groups(tok, [[1.0, 0.0, 0.5, 0.2], [0.0, 1.0, 1.0, 0.3]], a),
                         tok.pad_token_id)
    for c, factor in ((1.5, 1.5), (3.0, 2.0)):
        u, m = sgd_update(model, replace(a, tis=c), groups, tok.pad_token_id)
        assert m["sampler/logp_gap"] == pytest.approx(math.log(2), abs=1e-5)
        assert_same_update(u, {n: factor * v for n, v in base.items()})




def test_opsm_at_delta_0_drops_rows_on_rounding_noise_alone_and_its_metric_shows_it(loaded):
    """On-policy, the sampler's log-probs differ from the trainer's by rounding only (sampler/logp_gap ~ 1e-7), yet
    --opsm-delta 0 drops every completion with A < 0 whose mean drift is above 0: loss/opsm_frac is that share of
    the step's tokens, counted here by hand from the trainer's log-probs of the same rows."""
    a, model, tok = loaded
    a = replace(a, opsm_delta=0.0, micro_batch_size=16)
    groups, _ = rollout(a, model, tok, stub_reward(lambda i: float(i % 3 == 0)))  # A != 0 in every group
    b = grpo.collate(groups, tok.pad_token_id, "cpu")
    with torch.no_grad():
        logp, _ = grpo.token_logps(model, b["input_ids"], b["attention_mask"], b["mask"].shape[1])
    drift = (torch.where(b["mask"] > 0, b["sampler_logp"] - logp, 0).sum(-1) / b["mask"].sum(-1)).tolist()
    adv = [r["adv"] for r in groups]
    lengths = b["mask"].sum(-1).tolist()
    dropped = sum(n for n, d, A in zip(lengths, drift, adv) if A < 0 and d > 0)
    m = grpo.train_step(copy.deepcopy(model), None, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0),
                        groups, a)
    assert 0 < m["sampler/logp_gap"] < 1e-5 and m["train/rows"] == len(adv) == 8
    assert 0 < dropped and m["loss/opsm_frac"] == pytest.approx(dropped / sum(lengths), rel=1e-6)


@pytest.mark.parametrize("kw", [dict(temperature=0.7), dict(temperature=0.7, top_k=5, top_p=0.5)],
                         ids=["T=0.7", "T=0.7-top_k=5-top_p=0.5"])
def test_the_sampler_s_logps_are_the_trainer_s_at_a_temperature_and_under_top_k_p(loaded, kw):
    """At temperature 0.7, with top-k and top-p on, the sampler records log pi(token) of the tempered full
    distribution (before top-k/p cut it), which is what the trainer computes, both in generate() and as
    train_step's gap metric; the draws respect top-k and top-p (each token is among the k likeliest, and the
    mass of the tokens likelier than it is below top_p in the renormalised top-k)."""
    a, model, tok = loaded
    model = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.2)  # logits spread wider than a random tiny model's: the temperature shows
    a = replace(a, **kw)
    torch.manual_seed(0)
    rows = grpo.generate(model, tok, [{"record": {"prompt": t, "answer": ""}} for t in TEXTS for _ in range(4)], a)
    logp, mask = trainer_logps(model, tok, a, rows)
    drawn = padded([r["logp"] for r in rows], mask)
    assert ((logp - drawn).abs() * mask).max() < 1e-4
    at_1, _ = trainer_logps(model, tok, replace(a, temperature=1.0), rows)
    assert ((at_1 - drawn).abs() * mask).max() > 0.05  # what a sampler (or trainer) ignoring it would show
    for i, r in enumerate(rows):
        r.update(reward=[1.0, 0, 0, 1][i % 4], rewards={}, order=i // 4, is_teacher=False)
    m = grpo.train_step(model, None, torch.optim.SGD(model.parameters(), lr=0.0), rows, a)
    assert m["sampler/logp_gap"] < 1e-4
    if a.top_k:
        b = grpo.collate(rows, tok.pad_token_id, "cpu")
        with torch.no_grad():
            pos = (b["attention_mask"].cumsum(-1) - 1).clamp(min=0)
            hidden = model.get_decoder()(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                                         position_ids=pos).last_hidden_state[:, -mask.shape[1] - 1:-1]
            full = model.get_output_embeddings()(hidden).float() / a.temperature  # (N, C, V)
        top = full.topk(a.top_k, -1)
        token = b["input_ids"][:, -mask.shape[1]:, None]
        rank = (top.indices == token).float().argmax(-1)  # (N, C); 0 when not among them, checked next
        assert (top.indices == token).any(-1)[mask.bool()].all()
        above = (top.values.softmax(-1).cumsum(-1) - top.values.softmax(-1)).gather(-1, rank[..., None])[..., 0]
        assert (above[mask.bool()] < a.top_p).all()


# ============================================================================= tier 3: runs of grpo.py
KEYS = ["step", "reward/mean", "reward/std", "completion/mean_length", "completion/truncated_frac", "policy/entropy",
        "loss/clipfrac_low", "loss/clipfrac_high", "kl", "grad/norm", "groups/kept", "time/generate", "time/reward",
        "time/train", "tokens_per_second", "accuracy", "eval/accuracy", "sampler/logp_gap", "lr", "train/rows"]


@pytest.mark.parametrize("algo", list(grpo.PRESETS))
def test_each_preset_trains_two_steps_and_saves_a_loadable_adapter(tiny_dir, tmp_path, algo, capsys):
    """In bf16, what --dtype auto picks on a GPU (fp32 runs in the tests below)."""
    out = str(tmp_path / "out")
    main(["--algo", algo, "--model", tiny_dir, "--max-steps", "2", "--output-dir", out, "--dtype", "bf16"] + TINY
         + reward_file(tmp_path))
    assert capsys.readouterr().out.strip().endswith(f"grpo: step 2 saved in {out}/checkpoint; metrics in "
                                                    f"{out}/metrics.jsonl")
    rows = metrics(out, with_step_0=True)
    assert [r["step"] for r in rows] == [0, 1, 2] and list(rows[0]) == ["step", "eval/accuracy"]  # eval first
    assert not [k for k in KEYS if k not in rows[-1]]
    assert rows[1]["grad/norm"] > 0 and rows[1]["policy/entropy"] > 0
    import peft
    from transformers import AutoModelForCausalLM
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_dir), out + "/checkpoint")
    assert any(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)  # trained, saved, loaded
    args = json.load(open(out + "/checkpoint/grpo_args.json"))
    assert args["algo"] == algo and args["step"] == 2


@pytest.mark.parametrize("extra", [["--surrogate", "sapo", "--ratio", "sequence", "--num-iterations", "2"],
                                   ["--surrogate", "cispo", "--kl", "k2", "--dtype", "bf16"],
                                   ["--dual-clip", "3", "--kl", "k3_ratio", "--num-iterations", "2"]])
def test_newer_losses_and_kl_terms_train(tiny_dir, tmp_path, extra):
    out = str(tmp_path / "out")
    main(["--algo", "grpo", "--model", tiny_dir, "--max-steps", "2", "--output-dir", out] + TINY + extra
         + reward_file(tmp_path))
    rows = metrics(out)
    assert len(rows) == 2 and all(r["grad/norm"] > 0 and math.isfinite(r["loss"]) and r["kl"] >= 0 for r in rows)


def test_the_new_variants_train_together(tiny_dir, tmp_path):
    """Several new flags at once (and --algo grpo's KL loss), two steps; the KL in the reward is against the
    LoRA policy's adapter switched off."""
    out = str(tmp_path / "out")
    main(["--model", tiny_dir, "--max-steps", "2", "--output-dir", out] + TINY + ["--eval-every", "0"]
         + ["--surrogate", "kl_cov", "--kl-in-reward", "0.01", "--top-entropy-quantile", "0.5", "--entropy-coef",
            "0.01", "--tis", "2", "--tis-mode", "sequence_mask", "--tis-min", "0.5", "--opsm-delta", "0.5",
            "--num-iterations", "2"] + reward_file(tmp_path))
    rows = metrics(out)
    assert len(rows) == 2 and all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    assert all(r["train/rows"] == 8 and r["grad/norm"] > 0 for r in rows)  # the entropy bonus: no group skipped
    assert rows[0]["kl/in_reward"] == 0 and rows[1]["kl/in_reward"] != 0  # LoRA starts at the reference


def test_gdpo_trains_on_each_reward_apart(tiny_dir, tmp_path):
    out = str(tmp_path / "out")
    main(["--model", tiny_dir, "--max-steps", "2", "--output-dir", out] + TINY + ["--eval-every", "0"]
         + ["--adv-estimator", "gdpo"] + reward_file(tmp_path)[:2] + ["--rewards", "correct,format:0.5"])
    rows = metrics(out)
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) and r["grad/norm"] > 0 for r in rows)
    assert {"reward/correct", "reward/format", "reward/digits"} <= set(rows[0])


@pytest.mark.parametrize("extra", [["--load-in-4bit"], ["--optim", "adamw_8bit"], ["--optim", "paged_adamw_8bit"],
                                   ["--lora-r", "0", "--beta", "0.04", "--gradient-checkpointing"]])
def test_memory_options_train(tiny_dir, tmp_path, extra, capsys):
    out = str(tmp_path / "out")  # in bf16, as on a GPU (QLoRA: bf16 compute); sampling compiled where it can be
    main(["--algo", "grpo", "--model", tiny_dir, "--max-steps", "2", "--output-dir", out, "--dtype", "bf16",
          "--compile-generate", "on"] + TINY + extra + reward_file(tmp_path))
    rows = metrics(out)
    assert len(rows) == 2 and rows[0]["grad/norm"] > 0 and math.isfinite(rows[1]["kl"])
    uncompiled = "--load-in-4bit" in extra or "--lora-r" in extra  # bnb layers; bf16 autocast over fp32 weights
    assert ("sample uncompiled" in capsys.readouterr().err) == uncompiled


def mixed_files(tmp_path, n_prompts=4, relative=False):
    data = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(n_prompts)]
    path = write(tmp_path / "data.jsonl", [json.dumps(d) for d in data])
    pool = write(tmp_path / "pool.jsonl", [json.dumps({"prompt": d["prompt"], "completion": c, "reward": r})
                                           for d in data for c, r in ((f"\\boxed{{{d['answer']}}}", 1.0),
                                                                      ("No idea.", 0.0), ("\\boxed{7}", 0.0))])
    if relative:
        return ["--dataset", "data.jsonl", "--teacher-pool", "pool.jsonl"]
    return ["--dataset", path, "--teacher-pool", pool]


@pytest.mark.parametrize("extra", [[], ["--dtype", "bf16", "--num-iterations", "2"]])
def test_mixed_pool_run_with_split_grads(eos_dir, tmp_path, extra):
    """The metrics of a step's completions against their values recomputed from samples.jsonl (every group logged);
    the model ends completions at varied lengths (eos_dir), so a length's mean, max and truncated share differ."""
    out = str(tmp_path / "out")
    main(["--algo", "drgrpo", "--model", eos_dir, "--max-steps", "2", "--output-dir", out, "--teacher-per-group",
          "2", "--split-grads", "--log-samples", "2"] + NO_EVAL + extra + mixed_files(tmp_path) + reward_file(tmp_path))
    samples = [json.loads(line) for line in open(os.path.join(out, "samples.jsonl"))]
    answers = {f"What is {i} + {i}?": str(2 * i) for i in range(4)}  # mixed_files'
    mean = statistics.mean
    for m in metrics(out):
        ns, nt, cos = m["grad/norm_student"], m["grad/norm_teacher"], m["grad/cos_student_teacher"]
        assert m["grad/norm"] ** 2 == pytest.approx(ns ** 2 + nt ** 2 + 2 * ns * nt * cos, rel=1e-3)
        assert ns > 0 and nt > 0 and -1 <= cos <= 1
        rows = [r for r in samples if r["step"] == m["step"]]  # every completion of the step's B = 2 groups
        assert len(rows) == 2 * (4 + 2)
        for key, part in (("reward/mean", rows), ("reward/mean_student", [r for r in rows if not r["teacher"]]),
                          ("reward/mean_teacher", [r for r in rows if r["teacher"]])):  # reward/mean: both sources
            assert m[key] == pytest.approx(sum(r["reward"] for r in part) / len(part), abs=1e-6), key
        # README's other metrics of the step's completions, each over its rows (the sampled ones, or every one)
        students, teachers = [r for r in rows if not r["teacher"]], [r for r in rows if r["teacher"]]
        lengths = [r["length"] for r in students]
        assert m["reward/std"] == pytest.approx(statistics.stdev(r["reward"] for r in rows), abs=1e-6)
        assert m["accuracy"] == mean(R.correct(r["completion"], answers[r["prompt"]]) for r in students)
        assert m["completion/tokens"] == sum(lengths) and m["completion/max_length"] == max(lengths)
        assert m["completion/mean_length"] == m["completion/mean_length_student"] == pytest.approx(mean(lengths))
        assert m["completion/mean_length_teacher"] == pytest.approx(mean([r["length"] for r in teachers]))
        assert m["completion/truncated_frac"] == mean(r["truncated"] for r in students)
        assert all(r["length"] == 12 for r in students if r["truncated"])  # each row's own: cut ones ran to T
        for name in ("digits", "correct"):
            assert m[f"reward/{name}"] == pytest.approx(mean([r["rewards"][name] for r in students]), abs=1e-6)
        groups = [[r["reward"] for r in rows if r["prompt"] == p] for p in {r["prompt"] for r in rows}]
        assert m["groups/equal_frac"] == mean(min(g) == max(g) for g in groups)
    for g in {r["prompt"] for r in samples}:  # G_t = 2 of the pool's 3, drawn without replacement
        for step in (1, 2):
            picks = [r["completion"] for r in samples if r["prompt"] == g and r["step"] == step and r["teacher"]]
            assert len(set(picks)) == len(picks)
    teachers = [r for r in samples if r["teacher"]]
    assert {"No idea.", "\\boxed{7}"} <= {r["completion"] for r in teachers}  # any of the three, not the first two
    assert any(r["correct"] for r in teachers) and not all(r["correct"] for r in samples)  # accuracy can tell
    assert 0 < mean(r["truncated"] for r in samples if not r["teacher"]) < 1  # and truncated_frac


def test_samples_log_first_group_and_sampled_eval(tiny_dir, tmp_path, capsys):
    """--log-samples: every completion of K groups a step with its rewards and advantage (Dr. GRPO: R - mean of
    the group, by hand); the first group printed at step 1; --eval-samples adds mean@k and pass@k at step 0
    and at the last step, from a random stream of its own: the training rows are those of a run without it."""
    def go(name, extra):
        out = tmp_path / name
        main(["--algo", "drgrpo", "--model", tiny_dir, "--max-steps", "2", "--output-dir", str(out)] + TINY + extra
             + reward_file(tmp_path))
        return out, capsys.readouterr().err
    out, stderr = go("a", ["--log-samples", "1", "--eval-samples", "3", "--eval-every", "5"])
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] * 4 + [2] * 4  # 1 group of G = 4 a step
    for r in rows:
        assert r["reward"] == pytest.approx(r["rewards"]["digits"] + r["rewards"]["correct"], abs=1e-6)
        assert r["length"] <= 12 and (r["length"] == 12 or not r["truncated"]) and not r["teacher"]
    for step in (1, 2):
        group = [r for r in rows if r["step"] == step]
        mean = sum(r["reward"] for r in group) / 4
        assert [r["adv"] for r in group] == pytest.approx([r["reward"] - mean for r in group], abs=1e-6)
    first = [line for line in stderr.splitlines() if line.startswith("grpo: reward ")]
    assert len(first) == 4  # the first group (G = 4), once
    assert first[0].startswith(f"grpo: reward {rows[0]['reward']:.3g} {rows[0]['rewards']}: ")
    with_eval = metrics(out, with_step_0=True)
    assert [r["step"] for r in with_eval if "eval/accuracy" in r] == [0, 2]  # before training, and the last step
    for r in (with_eval[0], with_eval[-1]):
        assert 0 <= r["eval/mean@3"] <= r["eval/pass@2"] <= r["eval/pass@3"] <= 1
    assert not any("reward/mean_teacher" in r or "reward/mean_student" in r for r in with_eval)  # no pool
    plain, _ = go("b", ["--eval-every", "5"])
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(TIMING + ("eval/",))}  # noqa: E731
                          for r in rows]
    assert strip(metrics(out)) == strip(metrics(plain))


def test_the_step_s_times_and_throughput_by_a_clock_that_ticks_once_a_reading(tiny_dir, tmp_path, monkeypatch):
    """grpo.py's clock replaced by one that moves 1 s each time it is read: time/generate and time/reward add one
    tick a sampling round (dynamic sampling's refills: a second round), time/train one a step, and
    tokens_per_second is the step's completion tokens over the step's ticks, those and the few between them."""
    ticks = itertools.count(1.0)
    monkeypatch.setattr(grpo, "time", argparse.Namespace(time=lambda: float(next(ticks))))
    body = "n = 0\ndef r(c, a, **kw):  # step 1's first round all equal: a refill\n    global n\n    n += 1\n" \
           "    return 0.0 if n <= 10 else n % 2\n"
    main(["--model", tiny_dir, "--output-dir", str(tmp_path / "out"), "--max-steps", "2", "--algo", "dapo"] + TINY
         + reward_file(tmp_path, body)[:2] + ["--no-overlong-penalty"])  # (which would part round 1's rewards)
    rows = metrics(str(tmp_path / "out"))
    assert [r["groups/gen_rounds"] for r in rows] == [2, 1]
    for r in rows:
        assert r["time/generate"] == r["time/reward"] == r["groups/gen_rounds"] and r["time/train"] == 1
        seconds, rounds = r["completion/tokens"] / r["tokens_per_second"], r["groups/gen_rounds"]
        assert 3 * rounds + 1 < seconds < 3 * rounds + 5 and seconds == pytest.approx(round(seconds))


def test_the_learning_rate_logged_and_the_weight_decay_are_the_ones_applied(tiny_dir, tmp_path):
    """AdamW's first update moves a weight by lr · m / (√v + eps) = lr · g / (|g| + eps): by the learning rate where
    its gradient is far above eps. lora_B starts at 0, so after step 1 of a 4-step warm-up its largest entry is the
    lr logged, 1e-3 / 4 (not the flag's 1e-3). --weight-decay w adds -lr w θ (decoupled): lora_A (no gradient at
    step 1, with lora_B 0) ends at θ_0 (1 - lr w), where without it stays at θ_0."""
    argv = ["--model", tiny_dir, "--max-steps", "1", "--warmup-steps", "4", "--eval-every", "0"] + TINY \
        + reward_file(tmp_path)
    main(argv + ["--output-dir", str(tmp_path / "out")])
    lr = metrics(str(tmp_path / "out"))[0]["lr"]
    assert lr == 1e-3 / 4 and metrics(str(tmp_path / "out"))[0]["grad/norm"] > 0
    plain = trained(str(tmp_path / "out"))
    assert max(v.abs().max().item() for k, v in plain.items() if "lora_B" in k) == pytest.approx(lr, rel=1e-3)
    main(argv + ["--output-dir", str(tmp_path / "decayed"), "--weight-decay", "0.5"])
    for k, v in trained(str(tmp_path / "decayed")).items():
        want = plain[k] * (1 - lr * 0.5) if "lora_A" in k else plain[k]  # lora_B: decayed from 0
        assert torch.allclose(v, want, rtol=1e-6, atol=1e-9) and torch.equal(v, plain[k]) != ("lora_A" in k), k


def test_wandb_gets_every_line_of_the_metrics_file(tiny_dir, tmp_path, monkeypatch):
    """--wandb-project: a stand-in wandb module records what it is given: the run's flags, and each line of
    metrics.jsonl at its step, the evaluation before the first step too."""
    import importlib.machinery
    import types
    wandb, logged = types.ModuleType("wandb"), []
    wandb.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # found, as installed
    wandb.init = lambda project, config: logged.append((project, config["learning_rate"]))
    wandb.log = lambda m, step: logged.append((m, step))
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    out = str(tmp_path / "out")
    main(["--model", tiny_dir, "--output-dir", out, "--max-steps", "2", "--wandb-project", "p"] + TINY)
    assert logged == [("p", 1e-3)] + [(r, r["step"]) for r in metrics(out, with_step_0=True)]
    assert [r["step"] for r in metrics(out, with_step_0=True)] == [0, 1, 2]


def test_a_run_in_which_nothing_trains_says_so_once(tiny_dir, tmp_path, capsys):
    """Equal rewards in every group (no advantage): after 5 such steps in a row, one note saying so, and never again.
    Here steps 5 and 11 alone have a group of unequal rewards, their first (2 calls at start-up, then B x G = 8 a
    step): steps 6-10 make five in a row, and 12-16 would make five again; one group of two is not "every"."""
    body = "n = 0\ndef r(c, a, **kw):\n    global n\n    n += 1\n    return float((34 < n <= 38 or 82 < n <= 86) " \
           "and n % 2)\n"
    main(["--model", tiny_dir, "--output-dir", str(tmp_path / "out"), "--max-steps", "16"] + TINY
         + ["--eval-every", "0"] + reward_file(tmp_path, body)[:2])
    notes = [line for line in capsys.readouterr().err.splitlines() if "teach nothing" in line]
    assert notes == ["grpo: note: equal rewards in every group at steps 6-10, so the rewards teach nothing: try a "
                     "denser reward, a stronger model or easier prompts (--log-samples 1 shows them)"]
    equal = [r["groups/equal_frac"] for r in metrics(str(tmp_path / "out"))]
    assert equal == [1.0] * 4 + [0.5] + [1.0] * 5 + [0.5] + [1.0] * 5


def test_a_run_whose_rewards_overflow_their_group_s_std_stops_at_its_first_step(tiny_dir, tmp_path):
    """A reward of ±3e38 (finite, so score takes it) would make every advantage 0: the run stops at step 1, saying so."""
    body = "n = 0\ndef r(c, a, **kw):\n    global n\n    n += 1\n    return 3e38 * (-1) ** n\n"
    with pytest.raises(SystemExit, match=r"^grpo: error: rewards up to 3e\+38 overflow float32 in the advantages'"):
        main(["--model", tiny_dir, "--output-dir", str(tmp_path / "out"), "--max-steps", "2"] + TINY
             + ["--eval-every", "0"] + reward_file(tmp_path, body)[:2])
    assert not (tmp_path / "out" / "checkpoint").exists()


def test_readme_s_tiny_model_commands_each_have_an_output_dir_of_their_own():
    """README's commands on the tiny model, run one after the other as a new user does: a second one that met the
    first's grpo_out/ would be refused (it holds a run)."""
    readme = open(os.path.join(HERE, "README.md")).read()
    commands = re.findall(r"python grpo\.py --model tiny[^`]*", readme)
    dirs = [(re.findall(r"--output-dir (\S+)", c) or [grpo.Args.output_dir])[-1] for c in commands]
    assert len(commands) >= 2 and len(set(dirs)) == len(dirs), commands


def test_tiny_py_builds_a_model_from_the_command_line(tmp_path, monkeypatch, capsys):
    import runpy
    monkeypatch.setattr(sys, "argv", ["tiny.py", str(tmp_path / "m")])
    runpy.run_path(os.path.join(HERE, "tiny.py"), run_name="__main__")
    a = grpo.parse_args(["--model", str(tmp_path / "m"), "--tools", "calculator"])
    model, tok, _ = grpo.load_model(a, torch.device("cpu"))
    assert model.config.num_hidden_layers == 2 and grpo.load_tools(a, tok)["names"] == ["calculator"]  # (README's)
    monkeypatch.setattr(sys, "argv", ["tiny.py"])
    with pytest.raises(SystemExit, match="^usage: python tiny.py DIR"):
        runpy.run_path(os.path.join(HERE, "tiny.py"), run_name="__main__")


def test_full_fine_tuning_in_bf16_samples_uncompiled_with_a_note(tiny_dir, tmp_path, capsys):
    """bf16 autocast over fp32 weights gives keys (rotated in fp32) and values (bf16) two dtypes, which one static
    KV cache cannot hold (seen on an H100): that run samples uncompiled, and says so."""
    out = str(tmp_path / "out")
    main(["--model", tiny_dir, "--output-dir", out, "--max-steps", "1", "--lora-r", "0", "--dtype", "bf16",
          "--compile-generate", "on"] + TINY)
    assert "full fine-tuning in bf16, sample uncompiled" in capsys.readouterr().err
    assert metrics(out)[-1]["step"] == 1


def test_three_steps_with_evaluation_and_refill_compile_the_sampler_once(tiny_dir, tmp_path):
    out = str(tmp_path / "out")
    body = "n = 0\ndef r(c, a, **kw):  # step 1's first round all equal: a refill\n    global n\n    n += 1\n" \
           "    return 0.0 if n <= 10 else n % 2\n"
    p = cli(TINY + ["--model", tiny_dir, "--output-dir", out, "--algo", "dapo", "--max-steps", "3", "--eval-every",
                    "1", "--eval-samples", "2", "--compile-generate", "on", "--max-gen-rounds", "2"]
            + reward_file(tmp_path, body)[:2], env={**os.environ, "TORCH_LOGS": "recompiles"})
    assert "recompil" not in p.stderr.lower(), p.stderr[-3000:]
    rows = metrics(out)
    assert max(r["groups/gen_rounds"] for r in rows) == 2 and all("eval/pass@2" in r for r in rows)
    assert all(r["sampler/logp_gap"] < 1e-4 for r in rows if "sampler/logp_gap" in r)


def test_a_sampler_far_from_the_trainer_stops_the_run(tiny_dir, tmp_path, monkeypatch):
    real = grpo.generate

    def broken(*args, **kw):  # log-probs off by 1 nat, as a broken KV cache's or a stale weight's would be
        rows = real(*args, **kw)
        for r in rows:
            r["logp"] = r["logp"] - 1.0
        return rows
    monkeypatch.setattr(grpo, "generate", broken)
    with pytest.raises(SystemExit, match="the sampler's log-probs are 1.000 nat from the trainer's on average .*"
                                         "--compile-generate off"):
        main(["--model", tiny_dir, "--output-dir", str(tmp_path / "out"), "--max-steps", "3"] + TINY
             + reward_file(tmp_path))


def test_a_run_of_non_finite_steps_stops_and_keeps_the_last_finite_weights(tiny_dir, tmp_path, monkeypatch):
    common = ["--model", tiny_dir, "--save-every", "1"] + TINY + reward_file(tmp_path)
    main(common + ["--output-dir", str(tmp_path / "two"), "--max-steps", "2"])
    real, calls = grpo.policy_loss, []

    def poisoned(logp, *args):  # NaN from step 3 on, as an overflow would make
        calls.append(1)
        loss, diag, words = real(logp, *args)
        return (loss * float("nan") if len(calls) > 2 * 4 else loss), diag, words  # the probe, 3 micro-batches
    monkeypatch.setattr(grpo, "policy_loss", poisoned)
    with pytest.raises(SystemExit, match="3 steps in a row had a loss or gradient that was not finite; those "
                                         "updates were not applied: lower --learning-rate"):
        main(common + ["--output-dir", str(tmp_path / "bad"), "--max-steps", "9"])
    rows = metrics(str(tmp_path / "bad"))
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["train/not_finite"] == 1 for r in rows[2:])
    assert "loss" not in rows[2] and "grad/norm" not in rows[2]
    a, b = trained(str(tmp_path / "two")), trained(str(tmp_path / "bad"))
    assert all(torch.equal(a[k], b[k]) for k in a)  # steps 3-5 were never applied; step 4 was saved as it was


def test_an_error_outside_an_update_saves_the_last_step_and_says_so(tiny_dir, tmp_path, monkeypatch, capsys):
    """A reward that raises once, at step 3 (save every 50): the weights are step 2's, so step 2 is saved and the
    one line of the error says so; --resume continues from there. The same for an error that is a traceback (the
    sampler out of memory, say)."""
    (tmp_path / "rw.py").write_text("calls = []\ndef r(c, a, **kw):\n    calls.append(1)\n"
                                    "    if len(calls) == 2 + 2 * 8 + 1:  # the start-up check, steps 1 and 2\n"
                                    "        raise ValueError('a bug')\n    return len(c) % 3\n")
    out = str(tmp_path / "out")
    argv = ["--model", tiny_dir, "--output-dir", out, "--max-steps", "4", "--eval-every", "0"] + TINY
    with pytest.raises(SystemExit, match=r"^grpo: error: reward 'r' raised ValueError: a bug \(step 2 saved: "
                                         r"--resume continues\)$"):
        main(argv + ["--reward-fn", f"{tmp_path}/rw.py:r"])
    assert json.load(open(out + "/checkpoint/grpo_args.json"))["step"] == 2
    main(["--output-dir", out, "--resume", "--max-steps", "3"])
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]
    rollout = grpo.rollout
    def out_of_memory_at_step_3(*args, **kw):
        if len(metrics(out + "2")) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return rollout(*args, **kw)
    monkeypatch.setattr(grpo, "rollout", out_of_memory_at_step_3)
    capsys.readouterr()
    with pytest.raises(torch.OutOfMemoryError):
        main(["--model", tiny_dir, "--output-dir", out + "2", "--max-steps", "4", "--eval-every", "0"] + TINY)
    assert capsys.readouterr().err.splitlines()[-1] == f"grpo: step 2 saved in {out}2/checkpoint: --resume " \
                                                       f"continues; the error:"
    assert json.load(open(out + "2/checkpoint/grpo_args.json"))["step"] == 2


def test_a_keyboard_interrupt_that_no_signal_raised_is_an_error(tiny_dir, tmp_path):
    """A reward that raises KeyboardInterrupt at step 2 (a bug, or a library's way out), no signal sent: step 1 is
    saved, as for any error outside an update, and the run ends as an error (exit 1, with the traceback), not as a
    finished run (exit 0, "step 1 saved in ...") nor as one stopped by Ctrl-C (130)."""
    (tmp_path / "rw.py").write_text("calls = []\ndef r(c, a, **kw):\n    calls.append(1)\n"
                                    "    if len(calls) == 2 + 8 + 1:  # the start-up check, step 1\n"
                                    "        raise KeyboardInterrupt\n    return len(c) % 3\n")
    out = str(tmp_path / "out")
    p = cli(["--model", tiny_dir, "--output-dir", out, "--max-steps", "3"] + TINY
            + ["--eval-every", "0", "--reward-fn", f"{tmp_path}/rw.py:r"], check=False)
    assert p.returncode == 1 and p.stdout == "", p.stdout + p.stderr[-3000:]
    err = p.stderr.strip().splitlines()
    assert f"grpo: step 1 saved in {out}/checkpoint: --resume continues; the error:" in err
    assert "KeyboardInterrupt" in err and err[-1] == "RuntimeError: the KeyboardInterrupt above came from no signal: an error"
    assert json.load(open(out + "/checkpoint/grpo_args.json"))["step"] == 1


def test_a_save_that_fails_after_an_error_is_said_after_that_error(tiny_dir, tmp_path, monkeypatch, capsys):
    """The disk fills up: a reward's write fails at step 2, and so does the save of step 1 that this error calls
    for. The reward's error is said, then the failed save's line (not the save's alone); the same for an error
    that is a traceback (the sampler out of memory)."""
    (tmp_path / "rw.py").write_text("calls = []\ndef r(c, a, **kw):\n    calls.append(1)\n"
                                    "    if len(calls) == 2 + 8 + 1:  # the start-up check, step 1\n"
                                    "        raise OSError(28, 'No space left on device')\n    return len(c) % 3\n")
    out = str(tmp_path / "out")
    argv = ["--model", tiny_dir, "--max-steps", "3"] + TINY + ["--eval-every", "0"]
    monkeypatch.setattr(grpo.torch, "save", full_disk)
    full = "saving step 1 failed ([Errno 28] No space left on device); last checkpoint: none"
    with pytest.raises(SystemExit) as stop:
        main(argv + ["--output-dir", out, "--reward-fn", f"{tmp_path}/rw.py:r"])
    assert str(stop.value).splitlines() == ["grpo: error: reward 'r' raised OSError: [Errno 28] No space left on "
                                            "device", f"grpo: error: {full}"]
    rollout = grpo.rollout
    def out_of_memory_at_step_2(*args, **kw):
        if len(metrics(out + "2")) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return rollout(*args, **kw)
    monkeypatch.setattr(grpo, "rollout", out_of_memory_at_step_2)
    capsys.readouterr()
    with pytest.raises(SystemExit, match=rf"^grpo: error: {re.escape(full)}$"):
        main(argv + ["--output-dir", out + "2"])
    err = capsys.readouterr().err
    assert "Traceback" in err and "torch.OutOfMemoryError: CUDA out of memory" in err.splitlines()
    assert not os.path.exists(out + "/checkpoint") and not os.path.exists(out + "2/checkpoint")


def test_a_diverging_learning_rate_ends_in_one_line(tiny_dir, tmp_path):
    with pytest.raises(SystemExit, match="^grpo: error: the model's logits are not finite: training diverged; "
                                         "lower --learning-rate$"):
        main(["--model", tiny_dir, "--output-dir", str(tmp_path / "out"), "--max-steps", "5"] + TINY
             + ["--learning-rate", "1e30", "--eval-every", "0"] + reward_file(tmp_path))


@pytest.mark.parametrize("case, says", [
    ("reward calls sys.exit", "reward 'r' raised SystemExit"),
    ("reward file missing", "--reward-fn '.*nope.py:r': no such file or directory"),
    ("no such function", "--reward-fn: .*rw.py has no function 'nope'"),
    ("rewards weight nan", "--rewards: weight 'nan' of 'correct' is not a number finite in float32"),
    ("wandb missing", "--wandb-project: `pip install wandb`"),
    ("model missing", "--model '.*no-such-dir'"),
    ("model without weights", "--model '.*no-weights': .*no file named model.safetensors"),
    ("seed past 64 bits", r"^grpo: error: --seed must be in \[0, 2e18\], not 18446744073709551615$"),
    ("reward file exits", r"--reward-fn: .*exits.py called sys.exit\(0\) as it loaded"),
])
def test_every_input_is_checked_before_anything_is_written(tiny_dir, tmp_path, case, says, monkeypatch):
    out = tmp_path / "out"
    argv = ["--model", tiny_dir, "--output-dir", str(out)] + TINY
    (tmp_path / "rw.py").write_text("import sys\ndef r(c, a, **kw):\n    sys.exit(3)\n")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(0)\n")
    extra = {"reward calls sys.exit": ["--reward-fn", f"{tmp_path}/rw.py:r"],
             "reward file missing": ["--reward-fn", f"{tmp_path}/nope.py:r"],
             "reward file exits": ["--reward-fn", f"{tmp_path}/exits.py:r"],
             "no such function": ["--reward-fn", f"{tmp_path}/rw.py:nope"],
             "rewards weight nan": ["--rewards", "correct:nan"], "wandb missing": ["--wandb-project", "x"],
             "model missing": ["--model", str(tmp_path / "no-such-dir")],
             "model without weights": ["--model", str(tmp_path / "no-weights")],
             "seed past 64 bits": ["--seed", str(2 ** 64 - 1)]}[case]
    shutil.copytree(tiny_dir, tmp_path / "no-weights", ignore=shutil.ignore_patterns("*.safetensors"))
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(SystemExit, match=says):
        main(argv + extra)
    assert not out.exists()


# ----------------------------------------------------------------------------- keeping a run
def test_resume_continues_the_run_bit_for_bit_from_anywhere(tiny_dir, tmp_path):
    """4 steps in one run == 2 steps, stop, --resume to 4: the same metrics and the same adapter, bit for bit
    (optimizer, prompt stream with dynamic sampling's refills, torch and python RNG restored), so a run repeats
    itself. The resumed run starts in another directory (the relative paths were saved absolute), gives the
    teacher pool at a new path, and evaluates on other prompts: none of which changes what it trains. The
    learning rate warms up linearly over 3 steps, then holds (DAPO's warm-up), across the resume too. Two of the
    four prompts score 0 (their groups are dropped where the teacher's pool reward is 0 too): both steps before the
    stop sample again, so the resumed stream starts 2 rounds of B prompts a step on, not one. A term with
    memory is on: the KL in the reward with an adaptive β (--kl-target), which the run's state carries."""
    common = ["--algo", "dapo", "--model", tiny_dir, "--teacher-per-group", "1", "--max-gen-rounds", "2"] + TINY \
        + mixed_files(tmp_path, relative=True) + ["--eval-dataset", "data.jsonl"] \
        + ["--reward-fn", "rw.py:digits", "--warmup-steps", "3"] \
        + ["--no-overlong-penalty", "--kl-in-reward", "0.5", "--kl-target", "1e-3"]  # (the lengths' penalties
    # would part every group's rewards)
    reward_file(tmp_path, "def digits(c, a, prompt, **kw):\n    return 0.0 if prompt in ('What is 0 + 0?', "
                          "'What is 1 + 1?') else sum(ch.isdigit() for ch in c) / 10\n")
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    main(common + ["--output-dir", straight, "--max-steps", "4"], cwd=tmp_path)
    main(common + ["--output-dir", split, "--max-steps", "2"], cwd=tmp_path)
    moved = tmp_path / "moved"
    moved.mkdir()
    os.replace(tmp_path / "pool.jsonl", moved / "pool.jsonl")
    p = cli(["--output-dir", split, "--resume", "--max-steps", "4", "--teacher-pool", "moved/pool.jsonl",
             "--eval-prompts", "2"], cwd=tmp_path)
    assert p.stdout.strip().splitlines()[-1] == f"grpo: step 4 saved in {split}/checkpoint; metrics in " \
                                                f"{split}/metrics.jsonl"
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("eval/")} for r in steady(rows)]  # noqa
    assert strip(metrics(split)) == strip(metrics(straight)) and len(metrics(split)) == 4
    assert [r["groups/gen_rounds"] for r in metrics(straight)[:2]] == [2, 2]  # refills before the stop
    assert [r["lr"] for r in metrics(straight)] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3])
    coefs = [r["kl/in_reward_coef"] for r in metrics(straight)]  # β moved by ≤ 0.2·10 rows / 1e4 a step
    assert coefs[0] == 0.5 and len(set(coefs)) == 4 and all(abs(x / y - 1) <= 2e-4 for x, y in zip(coefs[1:], coefs))
    a, b = trained(straight), trained(split)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.load(open(split + "/checkpoint/grpo_args.json"))["teacher_pool"] == str(moved / "pool.jsonl")


def test_a_schedule_in_at_step_reaches_the_sampler_and_the_trainer_alike(tiny_dir, tmp_path, monkeypatch):
    """A schedule is a line in at_step (here the temperature, 0.6 at step 1 and 1.4 at step 2): the sampler and
    the trainer's log-probs both read the step's copy of the flags, so the sampler's log-probs are the
    trainer's (a trainer at another temperature would be nats off, and the run stopped as with stale weights),
    and the saved run's flags are the run's, not a step's."""
    real, sample, token_logps, used = grpo.at_step, grpo.sample, grpo.token_logps, []
    def scheduled(a, state, step):
        t = real(a, state, step)
        t.temperature = [0.6, 1.4][step - 1]
        return t
    def sampling(model, tok, held, new_tokens, a, *args, **kw):
        used.append(("sampler", a.temperature))
        return sample(model, tok, held, new_tokens, a, *args, **kw)
    def trainer(*args):
        used.append(("trainer", round(float(args[-1].max()), 4)))  # (a row's temperature, (N, 1))
        return token_logps(*args)
    monkeypatch.setattr(grpo, "at_step", scheduled)
    monkeypatch.setattr(grpo, "sample", sampling)
    monkeypatch.setattr(grpo, "token_logps", trainer)
    out = str(tmp_path / "out")
    main(["--model", tiny_dir, "--output-dir", out, "--max-steps", "2"] + TINY + ["--eval-every", "0"])
    assert sorted(set(used)) == [("sampler", 0.6), ("sampler", 1.4), ("trainer", 0.6), ("trainer", 1.4)]
    assert all(r["sampler/logp_gap"] < 1e-4 for r in metrics(out))
    assert json.load(open(out + "/checkpoint/grpo_args.json"))["temperature"] == 1.0


def test_a_prompt_s_own_temperature_reaches_the_sampler_and_the_trainer_alike(tiny_dir, tmp_path, monkeypatch):
    """A temperature a prompt is one place: draw gives a record its "temperature" (0.5 and 2, alternately). Each
    row is sampled at its prompt's, and the trainer's log-probs read the row's, so the sampler's log-probs are
    the trainer's (a trainer at --temperature 1 for every row would be tenths of a nat off)."""
    real, sample, used = grpo.draw, grpo.sample, []
    def draw(stream, a, state):
        prompts, words = real(stream, a, state)
        return [{**ex, "temperature": [0.5, 2.0][i % 2]} for i, ex in enumerate(prompts)], words
    def sampling(model, tok, held, new_tokens, a, greedy=False, sampler=None, temps=None):
        used.append(sorted(set(temps)))
        return sample(model, tok, held, new_tokens, a, greedy, sampler, temps)
    monkeypatch.setattr(grpo, "draw", draw)
    monkeypatch.setattr(grpo, "sample", sampling)
    out = str(tmp_path / "out")
    main(["--model", tiny_dir, "--output-dir", out, "--max-steps", "2"] + TINY + ["--eval-every", "0"])
    assert used == [[0.5, 2.0]] * 2 and all(r["sampler/logp_gap"] < 1e-4 for r in metrics(out))


@pytest.mark.parametrize("t", [0, -1.0, "0.7", None, math.inf])
def test_a_record_s_temperature_that_is_no_positive_number_is_refused_in_one_line(loaded, t):
    """A record's "temperature" (a fork's, or a dataset's field) is sampled at and divides the trainer's logits: 0
    would train on infinities, a string or None fail inside the sampler. Each is one line before sampling."""
    a, model, tok = loaded
    stream = iter([{"prompt": "1+1?", "answer": "2", "temperature": t}] * a.prompts_per_step)
    with pytest.raises(SystemExit, match=f"^grpo: error: a record's temperature must be a number above 0, not {t!r}$"):
        grpo.rollout(model, tok, stream, [("stub", lambda c, ans, **kw: 0.0, 1.0)], None, a, {"prompts_drawn": 0})


CURRICULUM = ["--reward-fn", "rw.py:solved_or_digits", "--rewards", "correct", "--no-overlong-penalty"]
SOLVED_OR_DIGITS = """def solved_or_digits(c, a, prompt, **kw):  # prompts 0 and 1: solved at once; 2 and 3: never
    return 1.0 if prompt in ('What is 0 + 0?', 'What is 1 + 1?') else min(0.9, sum(ch.isdigit() for ch in c) / 10)
"""


def test_a_curriculum_in_draw_and_a_schedule_over_max_steps_resume_bit_for_bit(tiny_dir, tmp_path, monkeypatch):
    """A researcher's curriculum, forked into draw alone: skip a prompt once a group of it was all correct,
    remembered in the run's state from state["scored"] (every rank's groups scored since the last draw). 4
    steps straight == 2, stop, --resume to 4, bit for bit: the state (what was solved, the stream's place,
    which the stream counts as each prompt is drawn, skipped ones too, with no line in the fork) is saved and
    restored. A schedule over the run's max_steps reads the first run's (2) after --resume --max-steps 4."""
    def curriculum(stream, a, state):
        solved = state.setdefault("solved", [])
        solved += [p for p, r in state.get("scored", []) if min(r) == 1.0 and p not in solved]
        drawn = []
        while len(drawn) < a.prompts_per_step:
            ex = next(stream)  # (the stream counts it in state, skipped or not)
            if ex["prompt"] not in solved:
                drawn.append(ex)
        return drawn, "unsolved prompts"
    real, horizons = grpo.at_step, []
    def recording(a, state, step):
        horizons.append((step, state["max_steps"]))
        return real(a, state, step)
    monkeypatch.setattr(grpo, "draw", curriculum)
    monkeypatch.setattr(grpo, "at_step", recording)
    (tmp_path / "rw.py").write_text(SOLVED_OR_DIGITS)
    common = ["--algo", "dapo", "--model", tiny_dir] + NO_EVAL + mixed_files(tmp_path)[:2] + CURRICULUM \
        + ["--log-samples", "2", "--max-gen-rounds", "2"]
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    main(common + ["--output-dir", straight, "--max-steps", "4"], cwd=tmp_path)
    main(common + ["--output-dir", split, "--max-steps", "2"], cwd=tmp_path)
    main(common + ["--output-dir", split, "--max-steps", "4", "--resume"], cwd=tmp_path)
    assert steady(metrics(split)) == steady(metrics(straight))
    a, b = trained(straight), trained(split)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    state = torch.load(straight + "/checkpoint/trainer_state.pt", weights_only=False)
    assert sorted(state["solved"]) == ["What is 0 + 0?", "What is 1 + 1?"]
    late = {r["prompt"] for r in map(json.loads, open(straight + "/samples.jsonl")) if r["step"] >= 3}
    assert late and not late & set(state["solved"])  # drawn no more
    rounds = sum(r["groups/gen_rounds"] for r in metrics(straight))
    assert state["prompts_drawn"] > 2 * rounds  # the skipped ones counted: the stream's place, as drawn
    assert horizons == [(1, 4), (2, 4), (3, 4), (4, 4), (1, 2), (2, 2), (3, 2), (4, 2)]
    assert "unsolved prompts" in grpo.describe(grpo.Args())  # --dry-run: the fork's words, from a made-up record


def test_resume_refuses_what_it_cannot_continue_in_one_line(tiny_dir, tmp_path, capsys):
    out = str(tmp_path / "out")
    main(["--model", tiny_dir, "--max-steps", "2", "--output-dir", out] + TINY)
    for flag, value in (("--num-generations", "8"), ("--algo", "dapo"), ("--learning-rate", "0.1")):
        with pytest.raises(SystemExit, match=f"--resume: {flag} is .* in the saved run"):
            grpo.parse_args(["--output-dir", out, "--resume", flag, value])
    assert grpo.parse_args(["--output-dir", out, "--resume", "--max-steps", "9"]).num_generations == 4
    with pytest.raises(SystemExit, match="--resume: no checkpoint in .*nowhere'$"):
        grpo.parse_args(["--output-dir", str(tmp_path / "nowhere"), "--resume"])
    capsys.readouterr()
    for steps in ("2", "1"):  # done, or asked for fewer steps than it has
        with pytest.raises(SystemExit) as stop:
            main(["--output-dir", out, "--resume", "--max-steps", steps])
        assert stop.value.code == 0
        assert capsys.readouterr().out == f"grpo: the run in {out} is at step 2: raise --max-steps to go on\n"


def test_a_term_that_remembers_per_prompt_reads_each_row_s_record_and_resumes_bit_for_bit(tiny_dir, tmp_path,
                                                                                          monkeypatch):
    """A row carries its record to the step's math: a per-prompt running baseline (A = R - b_p once prompt p
    has history, b_p the mean reward of its last trained group; Dr. GRPO's A before), forked into step_terms
    alone, keyed by s["record"] (every rank's rows' records, in s's order). Each row's A in samples.jsonl is
    checked by hand from the samples' rewards; 4 steps straight == 2, stop, --resume to 4, bit for bit."""
    step_terms, G = grpo.step_terms, 4
    def per_prompt_baseline(s, a, state):
        made, stats, words = step_terms(s, a, state)
        seen = state.setdefault("baseline", {})  # prompt -> b_p: the run's state, saved with it
        prompts = [r["prompt"] for r in s["record"]]
        base = torch.tensor([seen.get(p, math.nan) for p in prompts])[:, None]
        adv = torch.where(base.isnan(), made["row_adv"], s["reward"][:, None] - base)
        made.update(adv=adv, row_adv=adv, flat=made["flat"] & base.isnan())
        seen.update(zip(prompts[::G], s["reward"].view(-1, G).mean(1).tolist()))
        return made, stats, words
    monkeypatch.setattr(grpo, "step_terms", per_prompt_baseline)
    data = write(tmp_path / "d.jsonl", [json.dumps({"prompt": f"What is {i} + {i}?", "answer": str(2 * i)})
                                        for i in range(3)])
    common = ["--algo", "drgrpo", "--model", tiny_dir, "--dataset", data, "--log-samples", "2"] + NO_EVAL \
        + reward_file(tmp_path)
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    main(common + ["--output-dir", straight, "--max-steps", "4"])
    main(common + ["--output-dir", split, "--max-steps", "2"])
    main(common + ["--output-dir", split, "--max-steps", "4", "--resume"])
    a, b = trained(straight), trained(split)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    samples = [json.loads(line) for line in open(straight + "/samples.jsonl")]
    assert samples == [json.loads(line) for line in open(split + "/samples.jsonl")]
    history, repeated = {}, 0
    for step in range(1, 5):
        rows = [r for r in samples if r["step"] == step]
        for i in range(0, len(rows), G):
            group, prompt = rows[i:i + G], rows[i]["prompt"]
            mean = sum(r["reward"] for r in group) / G
            for r in group:  # Dr. GRPO's A without history, R - b_p with it
                assert r["adv"] == pytest.approx(r["reward"] - history.get(prompt, mean), abs=1e-6)
            repeated += prompt in history and mean != history[prompt]
            history[prompt] = mean
    assert repeated >= 2  # (b_p, not the group's mean, made A: the check could tell them apart)


def test_the_step_s_records_are_every_rank_s_in_the_step_s_order(loaded, monkeypatch):
    """s["record"][i] is the record of s's row i, whatever order a rank holds its rows in and whichever rank
    sampled it: here this rank holds groups 2 then 0, a second rank's groups 1 and 3 come back from the gathers."""
    a, model, tok = loaded
    rows = tiny.fixed_groups(tok, [[0, 1, 0, 1], [1, 0, 0, 0], [0, 0, 1, 1]], a)
    rows = [r for r in rows if r["order"] == 2] + [r for r in rows if r["order"] == 0]
    real, step_terms, seen = grpo.all_gather, grpo.step_terms, []
    def two_ranks(obj):  # the other rank: this one's rows as groups 1 and 3, its records its own
        if isinstance(obj, dict) and "order" in obj:
            return [obj, {**obj, "order": obj["order"] + 1}]
        if isinstance(obj, list) and obj and isinstance(obj[0], tuple) and isinstance(obj[0][1], dict):
            return [obj, [(o + 1, {"prompt": f"other {o + 1}", "answer": ""}) for o, _ in obj]]
        return real(obj)
    def seeing(s, a, state):
        seen.append(s)
        return step_terms(s, a, state)
    monkeypatch.setattr(grpo, "all_gather", two_ranks)
    monkeypatch.setattr(grpo, "step_terms", seeing)
    grpo.train_step(model, None, torch.optim.SGD(model.parameters(), lr=0.0), rows, a)
    want = {0: rows[4]["record"]["prompt"], 1: "other 1", 2: rows[0]["record"]["prompt"], 3: "other 3"}
    s = seen[-1]  # (probe's calls before it: made-up rows)
    assert s["order"].tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    assert [r["prompt"] for r in s["record"]] == [want[o] for o in s["order"].tolist()]


def test_no_silent_overwrite(tiny_dir, tmp_path):
    out = tmp_path / "out"
    argv = ["--model", tiny_dir, "--max-steps", "1", "--output-dir", str(out)] + TINY + ["--eval-every", "0"]
    main(argv)
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(SystemExit, match="holds a run: --resume continues it, --overwrite starts over"):
        main(argv)
    assert (out / "metrics.jsonl").read_text() == before
    main(argv + ["--overwrite", "--seed", "5"])
    assert (out / "metrics.jsonl").read_text() != before and len(metrics(str(out))) == 1


def test_a_run_that_stopped_before_its_first_save_does_not_block_its_folder(tiny_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.0}\n')
    with pytest.raises(SystemExit, match="--resume: no checkpoint in .*out'$"):
        grpo.parse_args(["--output-dir", str(out), "--resume"])
    (out / "samples.jsonl").write_text('{"step": 1}\n')
    main(["--model", tiny_dir, "--max-steps", "1", "--output-dir", str(out)] + TINY)
    assert [r["step"] for r in metrics(str(out), with_step_0=True)] == [0, 1]
    assert (out / "samples.jsonl").read_text() == ""  # nothing of the previous run is left


def test_metrics_of_a_run_never_saved_are_kept_unless_asked_and_resume_auto_starts_or_continues(tiny_dir, tmp_path):
    """A run killed before its first save leaves metrics and no checkpoint: a new run there is refused in one line
    (those rows are all that is left of it); --overwrite starts over. `--resume auto`, one command for a first
    launch and for its requeues, starts where nothing was saved (over such rows) and continues what was."""
    out = tmp_path / "out"
    out.mkdir()
    killed = '{"step": 0, "eval/accuracy": 0.0}\n{"step": 1, "reward/mean": 0.5}\n{"step": 2, "rew'
    (out / "metrics.jsonl").write_text(killed)
    argv = ["--model", tiny_dir, "--output-dir", str(out), "--eval-every", "0"] + TINY
    with pytest.raises(SystemExit, match=f"^grpo: error: --output-dir '{out}' holds the metrics of a run that stopped "
                                         f"before its first save: --overwrite starts over"):
        main(argv + ["--max-steps", "1"])
    assert (out / "metrics.jsonl").read_text() == killed
    main(argv + ["--max-steps", "1", "--resume", "auto"])
    first = (out / "metrics.jsonl").read_text()
    main(argv + ["--max-steps", "2", "--resume", "auto"])
    assert [r["step"] for r in metrics(str(out))] == [1, 2] and (out / "metrics.jsonl").read_text().startswith(first)


def test_a_run_started_with_overwrite_resumes_and_a_flag_newer_than_its_checkpoint_is_its_default(tiny_dir,
                                                                                                     tmp_path):
    """--overwrite is saved with the other flags, yet --resume continues that run (it once answered "give one").
    A flag the checkpoint does not hold (saved by an older grpo.py, or before a fork added it) counts as its
    default: given at that value the run resumes, given otherwise it is refused in one line (once a KeyError).
    A flag that only moves memory (--micro-batch-size, --gradient-checkpointing) may change."""
    out = str(tmp_path / "out")
    main(["--model", tiny_dir, "--output-dir", out, "--max-steps", "1", "--overwrite"] + TINY + ["--eval-every", "0"])
    args = tmp_path / "out" / "checkpoint" / "grpo_args.json"
    saved = json.loads(args.read_text())
    del saved["tis"]  # as if the checkpoint predated --tis
    args.write_text(json.dumps(saved))
    with pytest.raises(SystemExit, match=r"^grpo: error: --resume: --tis is 2.0 here but 0.0 in the saved run"):
        main(["--output-dir", out, "--resume", "--max-steps", "2", "--tis", "2"])
    main(["--output-dir", out, "--resume", "--max-steps", "2", "--tis", "0", "--micro-batch-size", "1"])  # memory
    assert [r["step"] for r in metrics(out)] == [1, 2]


def test_resume_from_the_old_checkpoint_and_a_partial_metrics_line(tiny_dir, tmp_path):
    """A save killed between its two renames leaves checkpoint.old/ alone: --resume continues from it. A crash
    mid-write leaves a partial last metrics line: it is dropped. Where both are whole (a save killed before it
    deleted .old/), the newer, checkpoint/, is the run's: step 2's run is done at --max-steps 2, and goes on to 3."""
    out = str(tmp_path / "out")
    main(["--model", tiny_dir, "--max-steps", "1", "--output-dir", out] + TINY)
    shutil.copytree(out + "/checkpoint", tmp_path / "step1")
    os.replace(out + "/checkpoint", out + "/checkpoint.old")
    with open(out + "/metrics.jsonl", "a") as f:
        f.write('{"step": 2, "reward/me')
    main(["--output-dir", out, "--resume", "--max-steps", "2"])
    assert [r["step"] for r in metrics(out)] == [1, 2] and not os.path.exists(out + "/checkpoint.old")
    shutil.copytree(tmp_path / "step1", out + "/checkpoint.old")
    with pytest.raises(SystemExit) as done:
        main(["--output-dir", out, "--resume", "--max-steps", "2"])
    assert done.value.code == 0 and grpo.last_checkpoint(out) == out + "/checkpoint"
    before = pathlib.Path(out, "metrics.jsonl").read_text()
    main(["--output-dir", out, "--resume", "--max-steps", "3"])
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]
    assert pathlib.Path(out, "metrics.jsonl").read_text().startswith(before)  # step 2 kept, not run again
    assert [r["step"] for r in metrics(out, with_step_0=True)] == [0, 1, 2, 3]  # the start evaluated once


def test_a_damaged_checkpoint_is_named_in_one_line_and_a_whole_old_one_is_used(tiny_dir, tmp_path, capsys):
    """A file missing or cut (a copy cut short, a full disk) is found by the sizes grpo_args.json lists, before
    anything loads (a missing adapter would send peft to the hub); a whole checkpoint.old/ is used instead."""
    out = str(tmp_path / "out")
    ckpt = out + "/checkpoint"
    main(["--model", tiny_dir, "--max-steps", "1", "--output-dir", out, "--eval-every", "0"] + TINY)
    shutil.copytree(ckpt, str(tmp_path / "whole"))
    cut = lambda path: os.truncate(path, os.path.getsize(path) // 2)  # noqa: E731
    for name, damage in (("adapter_model.safetensors", os.remove), ("adapter_model.safetensors", cut),
                         ("trainer_state.pt", cut), ("grpo_args.json", cut), ("grpo_args.json", os.remove)):
        damage(os.path.join(ckpt, name))
        with pytest.raises(SystemExit, match=f"^grpo: error: --resume: {ckpt}/{name} is missing or cut, and no "
                                             f"other checkpoint is whole: restore it$"):
            grpo.parse_args(["--output-dir", out, "--resume", "--max-steps", "2"])
        with pytest.raises(SystemExit, match="holds a run: --resume continues it, --overwrite starts over"):
            main(["--model", tiny_dir, "--output-dir", out] + TINY)  # nor is it overwritten unasked
        shutil.copy(tmp_path / "whole" / name, ckpt)
    state = pathlib.Path(ckpt, "trainer_state.pt")
    state.write_bytes(bytes(state.stat().st_size))  # whole by its size, zeros (a crash before the disk wrote it)
    with pytest.raises(SystemExit, match=f"^grpo: error: --resume: {ckpt}/trainer_state.pt cannot be read "
                                         f"\\(.*\\): restore it$"):
        main(["--output-dir", out, "--resume", "--max-steps", "2"])
    shutil.copy(tmp_path / "whole" / "trainer_state.pt", ckpt)
    shutil.copytree(ckpt, out + "/checkpoint.old")
    os.remove(ckpt + "/adapter_model.safetensors")
    capsys.readouterr()
    main(["--output-dir", out, "--resume", "--max-steps", "2"])
    assert f"grpo: {ckpt}/adapter_model.safetensors is missing or cut: resuming from {out}/checkpoint.old" \
        in capsys.readouterr().err.splitlines()
    assert [r["step"] for r in metrics(out)] == [1, 2] and grpo.last_checkpoint(out) == ckpt


@pytest.fixture(scope="module")
def saves(tiny_dir, tmp_path_factory):
    """What a 2-step run leaves (saved at steps 1 and 2), and the flags it ran with: each a state's parts."""
    where = tmp_path_factory.mktemp("saves")
    data = write(where / "data.jsonl", [json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)})
                                        for i in range(4)])
    argv = ["--model", tiny_dir, "--dataset", data, "--eval-every", "0"] + NO_EVAL + ["--output-dir", str(where / "run")]
    main(argv + ["--max-steps", "1"])
    shutil.copytree(where / "run" / "checkpoint", where / "step1")
    main(argv + ["--max-steps", "2", "--resume"])
    return where, argv[:-2] + ["--max-steps", "3"]


MODES = {"new": [], "--resume": ["--resume"], "--resume auto": ["--resume", "auto"], "--overwrite": ["--overwrite"]}
NONE_SAVED, HELD, NEVER_SAVED = "--resume: no checkpoint in", "holds a run: --resume continues", "holds the metrics"
CUT = "--resume: .*/checkpoint/adapter_model.safetensors is missing or cut, and no other checkpoint is whole"
STATES = {  # what each mode does in what a run and its saves can leave: the step it continues from (0: it starts
    # a new run), or its refusal                                            new         --resume    auto  --overwrite
    "nothing":                                                              [0,           NONE_SAVED, 0,    0],
    "metrics (a run stopped before its first save)":                        [NEVER_SAVED, NONE_SAVED, 0,    0],
    "metrics, checkpoint.tmp (its first save killed)":                      [NEVER_SAVED, NONE_SAVED, 0,    0],
    "metrics, checkpoint":                                                  [HELD,        2,          2,    0],
    "metrics, checkpoint, checkpoint.old (a save killed before its end)":   [HELD,        2,          2,    0],
    "metrics, checkpoint.old (a save killed between its renames)":          [HELD,        1,          1,    0],
    "metrics, checkpoint cut, checkpoint.old":                              [HELD,        1,          1,    0],
    "metrics, checkpoint cut":                                              [HELD,        CUT,        CUT,  0]}


@pytest.mark.parametrize("state, mode, want", [(state, mode, want) for state, wants in STATES.items()
                                               for mode, want in zip(MODES, wants)])
def test_every_resume_mode_in_every_state_a_save_can_leave(saves, tmp_path, state, mode, want):
    """Each mode's decision, made as a run starts (parse_args and start, no step): a run that continues reads the
    newest whole checkpoint and deletes nothing; a new run deletes what was there; a refusal leaves it all."""
    where, argv = saves
    out = tmp_path / "out"
    for part in state.split(" (")[0].split(", "):  # step 2's checkpoint, step 1's as .old/
        if part == "metrics":
            out.mkdir()
            for name in ("metrics.jsonl", "samples.jsonl"):
                shutil.copy(where / "run" / name, out)
        elif part == "checkpoint.tmp":  # a save killed before it wrote its last file
            shutil.copytree(where / "run" / "checkpoint", out / part, ignore=shutil.ignore_patterns("*.json"))
        elif part != "nothing":
            shutil.copytree(where / ("step1" if part == "checkpoint.old" else "run/checkpoint"), out / part.split()[0])
        if part == "checkpoint cut":
            os.truncate(out / "checkpoint" / "adapter_model.safetensors", 100)
    listing = lambda: sorted(set(os.listdir(out)) - {".lock"}) if out.exists() else []  # noqa: E731
    before = listing()
    try:
        run = grpo.start(grpo.parse_args(argv + ["--output-dir", str(out)] + MODES[mode]))
    except SystemExit as e:
        assert isinstance(want, str) and re.search(want, str(e)), str(e)
        assert listing() == before
        assert not out.exists() or (out / "metrics.jsonl").read_text() == (where / "run" / "metrics.jsonl").read_text()
        return
    for f in (run.bar, run.log, run.samples):
        f.close()
    assert run.start == want
    if want:  # continued from the checkpoint of that step, and nothing deleted
        assert listing() == before and [r["step"] for r in metrics(str(out))] == list(range(1, want + 1))
    else:  # a new run: nothing of the old one is left
        assert not [name for name in listing() if name.startswith("checkpoint")]
        assert (out / "metrics.jsonl").read_text() == ""


def test_resume_refuses_another_base_model_and_names_a_changed_file(tiny_dir, tmp_path, capsys):
    """Paths may move on --resume, content may not change silently: other weights of the same shapes are refused
    in one line; an identical copy of the model elsewhere resumes; a reward file that changed (a fixed bug, say)
    is named in a note, and the run goes on with it."""
    out = str(tmp_path / "out")
    main(["--model", tiny_dir, "--max-steps", "1", "--output-dir", out, "--eval-every", "0"] + TINY
         + reward_file(tmp_path))
    other = tiny.make_tiny(str(tmp_path / "other"), seed=1)
    with pytest.raises(SystemExit, match=f"^grpo: error: --resume: --model '{other}' is not the model the run "
                                         f"started from \\(its config or weights differ, or it is not there\\)"):
        grpo.parse_args(["--output-dir", out, "--resume", "--model", other, "--max-steps", "2"])
    for flag, value in (("--reward-fn", f"{tmp_path}/rw.py:other"), ("--dataset", f"{tmp_path}/rw.py"),
                        ("--reward-fn", "")):  # another function of the file; a path where none was; none
        with pytest.raises(SystemExit, match=f"^grpo: error: --resume: {flag} is '{value}' here but .* in the "
                                             f"saved run: a path may move, but name the same thing$"):
            grpo.parse_args(["--output-dir", out, "--resume", flag, value, "--max-steps", "2"])
    moved = shutil.copytree(tiny_dir, tmp_path / "moved")
    reward_file(tmp_path, "def digits(c, a, **kw):\n    return sum(ch.isdigit() for ch in c) / 20\n")
    capsys.readouterr()
    main(["--output-dir", out, "--resume", "--model", str(moved), "--max-steps", "2"])
    notes = [line for line in capsys.readouterr().err.splitlines() if "note" in line]
    assert notes == ["grpo: note: the --reward-fn file has changed since the run was saved"]
    assert [r["step"] for r in metrics(out)] == [1, 2]


def test_resume_refuses_another_fine_tune_of_the_same_shapes(tmp_path):
    """Every layer's q_proj changed, the rest as it was: not at a weight file's ends, which were all that was read.
    A weight file of up to 128 MiB is read whole, a larger one in 1,024 reads spread over it (here, a smaller span
    stands for 64 MiB)."""
    from transformers import AutoModelForCausalLM
    base = tiny.make_tiny(str(tmp_path / "base"), layers=4, hidden=256)
    model = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.add_(0.01)
    model.save_pretrained(tmp_path / "tuned")
    tuned, copy_ = str(tmp_path / "tuned"), shutil.copytree(base, tmp_path / "copy")
    out = tmp_path / "out" / "checkpoint"
    out.mkdir(parents=True)  # a checkpoint as save() leaves it, of a run that started from base
    (out / "grpo_args.json").write_text(json.dumps({**vars(grpo.Args(model=base)), "step": 1, "sizes": {},
                                                   "files": {"model": grpo.fingerprint(base)}}))
    with pytest.raises(SystemExit, match=f"^grpo: error: --resume: --model '{tuned}' is not the model the run"):
        grpo.parse_args(["--output-dir", str(out.parent), "--resume", "--model", tuned])
    assert grpo.parse_args(["--output-dir", str(out.parent), "--resume", "--model", str(copy_)]).model == str(copy_)
    span = 1 << 16
    assert grpo.fingerprint(tuned, span=span) != grpo.fingerprint(base, span=span) == grpo.fingerprint(copy_, span=span)


def test_resume_takes_the_tokenizer_saved_with_the_run(tiny_dir, tmp_path):
    """The checkpoint's tokenizer, not --model's: a chat template edited in the model's directory since the run
    started would change every prompt of a run that resumes bit for bit (the weights' check does not read it)."""
    out = str(tmp_path / "out")
    main(["--model", tiny_dir, "--max-steps", "1", "--output-dir", out, "--eval-every", "0"] + TINY)
    moved = shutil.copytree(tiny_dir, tmp_path / "moved")
    (moved / "chat_template.jinja").write_text("{{ 'edited' }}")
    a = grpo.parse_args(["--output-dir", out, "--resume", "--model", str(moved), "--max-steps", "2"])
    _, tok, _ = grpo.load_model(a, torch.device("cpu"), os.path.join(out, "checkpoint"))
    assert tok.chat_template == (pathlib.Path(tiny_dir) / "chat_template.jinja").read_text()


def held_judge(tmp_path, out, after=0):
    """A reward a test can hold: while tmp_path/hold exists, once the run's metrics.jsonl holds `after` lines (so
    never in the start-up check, which comes before the output dir is written), a call writes tmp_path/held<rank>
    and waits. A test waits on that file, not on the clock: the run is then in a rollout, held in the judge."""
    (tmp_path / "judge.py").write_text(
        f"import os, time\nhold, held, log = {str(tmp_path / 'hold')!r}, {str(tmp_path / 'held')!r}, "
        f"{out + '/metrics.jsonl'!r}\n"
        "def r(c, a, **kw):\n"
        f"    if os.path.exists(hold) and os.path.exists(log) and open(log).read().count('\\n') >= {after}:\n"
        "        open(held + os.environ.get('RANK', '0'), 'w').close()\n"
        "        while os.path.exists(hold):\n"
        "            time.sleep(0.05)\n"
        "    return len(c) % 3\n")
    return ["--reward-fn", f"{tmp_path}/judge.py:r"]


def default_signals():
    """In the child: the stop signals as a terminal's foreground job has them. A script's background job (`cmd &`
    in a non-interactive shell), and so the suite run as one, inherits SIGINT and SIGQUIT ignored, which grpo.py
    (as every program) keeps ignored: a test of Ctrl-C would then wait out its deadline for nothing."""
    for sig in grpo.STOPS:
        signal.signal(sig, signal.SIG_DFL)


def background(tmp_path, argv, name=""):
    """A process whose stdout and stderr go to files (a pipe that nobody reads can fill and stop it)."""
    out, err = (open(tmp_path / (name + f), "w") for f in ("stdout", "stderr"))
    p = subprocess.Popen(argv, cwd=HERE, stdout=out, stderr=err, text=True, preexec_fn=default_signals)
    p.out, p.err = (tmp_path / (name + "stdout")).read_text, (tmp_path / (name + "stderr")).read_text
    return p


def wait_for(what, ready, p, timeout=240):
    """Polls ready() until it holds; fails at once, with the process's stderr, if the process ended first, and
    with a sentence after `timeout` s (a deadline for a hang, never the verdict on a working run)."""
    deadline = time.time() + timeout
    while not ready():
        assert p.poll() is None, f"exited {p.returncode} before {what}:\n{p.err()[-3000:]}"
        assert time.time() < deadline, f"no {what} after {timeout} s:\n{p.err()[-3000:]}"
        time.sleep(0.05)


def stop(p, sig):
    """Sends sig and waits for the process to exit (a deadline for a run that wrongly waits on a held judge)."""
    p.send_signal(sig)
    try:
        return p.wait(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError(f"still running 120 s after signal {sig}: it waited for the held step") from None


def logged(out):
    """metrics.jsonl's whole lines (a line being written is not read), training steps only."""
    if not os.path.exists(out + "/metrics.jsonl"):
        return []
    with open(out + "/metrics.jsonl") as f:
        return [r for r in map(json.loads, (line for line in f if line.endswith("\n"))) if r["step"]]


def test_a_signal_saves_the_last_step_at_once_and_one_run_holds_the_dir(tiny_dir, tmp_path):
    """SIGTERM (what a scheduler or `kill` sends; Ctrl-C's SIGINT in the next test) that lands in a rollout, here
    in a judge held until the run stops, does not wait for the step: the last completed step is saved at once and
    the run exits 128 + signal, what a scheduler reads as "killed". Meanwhile a new run in the output dir is
    refused, and a requeued one (`--resume auto`, the same command as the first launch) waits for the lock before
    it reads anything, then continues from that last save, not from the checkpoint it found when it started;
    SIGUSR1 (`sbatch --signal=USR1@T`, the time limit near) stops it as SIGTERM does."""
    out = str(tmp_path / "out")
    grpo_py = [sys.executable, os.path.join(HERE, "grpo.py")]
    p = background(tmp_path, grpo_py + ["--model", tiny_dir, "--output-dir", out, "--max-steps", "10000",
                                        "--save-every", "1", "--resume", "auto"] + TINY + held_judge(tmp_path, out))
    q = None
    try:
        wait_for("checkpoint", lambda: os.path.exists(out + "/checkpoint"), p)
        with pytest.raises(SystemExit, match=f"--output-dir '{out}' is in use by another run"):
            main(["--model", tiny_dir, "--output-dir", out, "--overwrite"] + TINY)
        q = background(tmp_path, grpo_py + ["--output-dir", out, "--resume", "auto", "--max-steps", "20000"], "q")
        wait_for("a wait", lambda: f"'{out}' is in use by another run: waiting for it to end" in q.err(), q)
        (tmp_path / "hold").touch()
        wait_for("held judge", (tmp_path / "held0").exists, p)
        rows = len(logged(out))  # steps 1..rows are done and saved; step rows + 1 is in its rollout, held
        assert stop(p, signal.SIGTERM) == 128 + signal.SIGTERM, p.err()[-3000:]
        first = open(out + "/metrics.jsonl").read().splitlines()[:rows + 1]  # (step 0, the evaluation, too)
        (tmp_path / "hold").unlink()
        wait_for("a step of the requeued run", lambda: len(logged(out)) > rows, q)
        assert stop(q, signal.SIGUSR1) == 128 + signal.SIGUSR1, q.err()[-3000:]
    finally:
        (tmp_path / "hold").unlink(missing_ok=True)
        for r in (p, q):
            r and r.kill()
    assert p.out().strip().splitlines()[-1] == f"grpo: stopped at step {rows}: --resume to continue " \
                                              f"({out}/checkpoint; metrics in {out}/metrics.jsonl)"
    assert "Traceback" not in p.err() + q.err()
    assert open(out + "/metrics.jsonl").read().splitlines()[:rows + 1] == first  # its steps, as that run logged
    step = json.load(open(out + "/checkpoint/grpo_args.json"))["step"]
    assert step == metrics(out)[-1]["step"] > rows
    import peft
    from transformers import AutoModelForCausalLM
    peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_dir), out + "/checkpoint")


def test_a_signal_while_a_step_is_saved_stops_after_that_step(tiny_dir, tmp_path, monkeypatch, capsys):
    """A signal that lands while a step is logged and saved stops the run there, not one whole step later,
    and that step is not saved twice."""
    out = str(tmp_path / "out")
    save = grpo.save
    saved = []
    def save_and_signal(model, tok, a, state):
        save(model, tok, a, state)
        saved.append(state["step"])
        if len(saved) == 1:  # the handler runs at once and, the step being busy, only sets run.stop
            os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(grpo, "save", save_and_signal)
    with pytest.raises(SystemExit) as stop:
        main(["--model", tiny_dir, "--max-steps", "4", "--output-dir", out, "--save-every", "1"] + TINY)
    assert stop.value.code == 128 + signal.SIGTERM and saved == [1]
    assert [r["step"] for r in metrics(out)] == [1]
    assert json.load(open(out + "/checkpoint/grpo_args.json"))["step"] == 1
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("grpo: stopped at step 1: --resume")


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT])
def test_signals_inside_a_save_do_not_break_it_and_others_stop_as_sigterm_does(tiny_dir, tmp_path, monkeypatch,
                                                                                capsys, sig):
    """SIGHUP (the terminal closed), SIGUSR1 or SIGUSR2 (`sbatch --signal=USR1@T`, submitit's USR2: the time limit
    is near) or SIGQUIT in a rollout stops the run as SIGTERM does: the last completed step is saved at once. A
    Ctrl-C and a SIGTERM that land inside that save are only noted: it completes, and the run exits 128 + the first
    signal."""
    out = str(tmp_path / "out")
    rollout, save = grpo.rollout, grpo.save
    calls = []
    def hang_up_in_step_2(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), sig)
        return rollout(*args, **kw)
    def save_with_signals(*args):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        save(*args)
    monkeypatch.setattr(grpo, "rollout", hang_up_in_step_2)
    monkeypatch.setattr(grpo, "save", save_with_signals)
    signal.signal(sig, lambda *_: pytest.fail(f"{sig!r} is not handled"))  # (as is, it kills pytest, or is ignored)
    try:
        with pytest.raises(SystemExit) as stop:
            main(["--model", tiny_dir, "--max-steps", "3", "--output-dir", out, "--eval-every", "0"] + TINY)
    except KeyboardInterrupt:
        pytest.fail("a Ctrl-C inside the save broke it")
    assert stop.value.code == 128 + sig and len(calls) == 2
    assert json.load(open(out + "/checkpoint/grpo_args.json"))["step"] == metrics(out)[-1]["step"] == 1
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("grpo: stopped at step 1: --resume")


def test_a_signal_inside_the_last_save_leaves_a_finished_run(tiny_dir, tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "out")
    save = grpo.save
    def save_with_signal(*args):
        os.kill(os.getpid(), signal.SIGTERM)
        save(*args)
    monkeypatch.setattr(grpo, "save", save_with_signal)
    main(["--model", tiny_dir, "--max-steps", "1", "--output-dir", out, "--eval-every", "0"] + TINY)  # exit 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"grpo: step 1 saved in {out}/checkpoint; metrics " \
                                                               f"in {out}/metrics.jsonl"


def test_an_ignored_signal_stays_ignored():
    """Under nohup (SIGHUP ignored) a closed terminal does not stop the run; the others are handled."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    grpo.on_signal(argparse.Namespace(stop=0, rank=0, busy=False))
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN and signal.getsignal(signal.SIGTERM) is not \
        signal.SIG_IGN


def test_ctrl_c_while_starting_is_one_line(tiny_dir, tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kw):
        raise KeyboardInterrupt  # what Ctrl-C raises while the model loads
    monkeypatch.setattr(grpo, "load_model", interrupted)
    try:
        with pytest.raises(SystemExit) as stop:
            main(["--model", tiny_dir, "--output-dir", str(tmp_path / "out")] + TINY)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C while starting ends in a traceback")
    assert stop.value.code == 128 + signal.SIGINT
    assert capsys.readouterr().err == "grpo: stopped while starting: nothing saved\n"


def test_sigterm_while_starting_is_one_line(tmp_path):
    """SIGTERM (a scheduler's, `kill`'s) while the run starts, here while it waits for the lock of the run in
    --output-dir, stops it as Ctrl-C does: one line, exit 128 + SIGTERM, nothing written."""
    out = tmp_path / "out"
    out.mkdir()
    with open(out / ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another run's
        p = background(tmp_path, [sys.executable, os.path.join(HERE, "grpo.py"), "--output-dir", str(out), "--resume"])
        try:
            wait_for("a wait", lambda: "is in use by another run: waiting for it to end" in p.err(), p)
            assert stop(p, signal.SIGTERM) == 128 + signal.SIGTERM, p.err()[-3000:]
        finally:
            p.kill()
    assert p.err().splitlines()[-1] == "grpo: stopped while starting: nothing saved" and "Traceback" not in p.err()
    assert os.listdir(out) == [".lock"]


def test_an_output_dir_that_cannot_be_made_or_that_a_run_deletes_is_refused_first(tiny_dir, tmp_path, monkeypatch):
    """Under a file or a device, or inside another run's checkpoint/ (.old/, .tmp/), which its next save deletes:
    one line, before the model loads."""
    monkeypatch.setattr(grpo, "load_model", lambda *args: pytest.fail("the model loaded"))
    run = tmp_path / "run"  # what a run leaves in its output dir
    (run / "checkpoint").mkdir(parents=True)
    (run / ".lock").touch()
    (tmp_path / "file").touch()
    for out, says in ((tmp_path / "file" / "out", f"cannot be made: '{tmp_path}/file' is not a directory we can"),
                      (pathlib.Path("/dev/null/out"), "cannot be made: '/dev/null' is not a directory we can write$"),
                      (pathlib.Path("/proc/out"), "cannot be made: '/proc' is not a directory we can write$"),
                      (run / "checkpoint", f"is inside a checkpoint of the run in '{run}'$"),
                      (run / "checkpoint.old" / "x", f"is inside a checkpoint of the run in '{run}'")):
        with pytest.raises(SystemExit, match=f"^grpo: error: --output-dir '{out}' {says}"):
            main(["--model", tiny_dir, "--output-dir", str(out)] + TINY)


def test_an_empty_output_dir_is_refused_without_locking_the_working_directory(tmp_path, monkeypatch):
    """parse_args takes the output dir's lock before it checks the flags: '' (the working directory, to abspath)
    is refused before any .lock is made there."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="--output-dir must name a directory"):
        grpo.parse_args(["--output-dir", ""])
    assert os.listdir(tmp_path) == []


def test_a_signal_before_the_first_step_ends_saves_nothing_and_says_so(tiny_dir, tmp_path):
    out = str(tmp_path / "out")
    (tmp_path / "hold").touch()  # step 1's judge is held
    p = background(tmp_path, [sys.executable, os.path.join(HERE, "grpo.py"), "--model", tiny_dir, "--output-dir", out,
                              "--max-steps", "3"] + TINY + held_judge(tmp_path, out))
    try:
        wait_for("held judge", (tmp_path / "held0").exists, p)
        assert stop(p, signal.SIGINT) == 128 + signal.SIGINT, p.err()[-3000:]
    finally:
        (tmp_path / "hold").unlink()
        p.kill()
    assert p.out().strip().splitlines()[-1] == "grpo: stopped before step 1 ended: nothing saved"
    assert not os.path.exists(out + "/checkpoint")


# ----------------------------------------------------------------------------- several processes (torchrun, gloo)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def test_each_rank_samples_and_draws_teachers_of_its_own_from_one_prompt_order(tiny_dir, tmp_path, monkeypatch):
    """start() as rank 0 and rank 1 of 2 (in this process; no process group is needed for what is compared): the
    ranks start from one LoRA init, read one prompt order (each takes its share of a round from it), and, given the
    same prompt, sample other completions and draw other teachers from the pool (their random states are seeded
    apart: --seed + 1000 * rank), the same ones in every run of that seed."""
    data = write(tmp_path / "data.jsonl", [json.dumps({"prompt": f"What is {i} + {i}?", "answer": str(2 * i)})
                                           for i in range(6)])
    pool = write(tmp_path / "pool.jsonl", [json.dumps({"prompt": f"What is {i} + {i}?", "completion": f"c{j}",
                                                       "reward": j}) for i in range(6) for j in range(6)])
    one = {"prompt": "What is 1 + 1?", "answer": "2"}  # every group of a round: the same prompt on both ranks

    def draws(rank, out):
        monkeypatch.setattr(grpo, "setup_distributed", lambda: (rank, 2, torch.device("cpu")))
        a = grpo.parse_args(["--model", tiny_dir, "--output-dir", str(tmp_path / out), "--dataset", data,
                             "--teacher-pool", pool, "--teacher-per-group", "3"] + NO_EVAL)
        run = grpo.start(a)
        order = [next(run.stream)["prompt"] for _ in range(12)]
        rows = grpo.rollout(run.model, run.tok, itertools.repeat(one), run.reward_fns, run.pool, a, run.state, None,
                            rank, 2)[2]
        for f in (run.bar, run.log, run.samples) if rank == 0 else ():
            f.close()
        lora = torch.cat([p.detach().flatten() for p in run.model.parameters() if p.requires_grad]).tolist()
        assert [r["is_teacher"] for r in rows] == ([False] * 4 + [True] * 3) * (len(rows) // 7) and rows
        return (order, [r["completion"].tolist() for r in rows if not r["is_teacher"]],
                [r["text"] for r in rows if r["is_teacher"]], lora)
    order, samples, teachers, lora = draws(0, "zero")
    other = draws(1, "one")
    assert other[3] == lora  # one LoRA init: the gradients are summed over ranks onto the same weights
    assert other[0] == order == [ex["prompt"] for ex in itertools.islice(grpo.prompt_stream(grpo.load_data(
        grpo.parse_args(["--dataset", data]))[0], 0), 12)]
    assert other[1] != samples and set(map(tuple, other[1])).isdisjoint(map(tuple, samples))
    assert other[2] != teachers and draws(1, "again") == other


def test_two_processes_give_the_one_process_update(tiny_dir, tmp_path):
    """Same completions, whole groups split over 2 ranks: the same parameter update as one process,
    for token-mean, seq-mean-token-sum-norm, and seq-mean-token-mean with the per-source split."""
    one, two = str(tmp_path / "one.pt"), str(tmp_path / "two.pt")
    for cmd, out in (([sys.executable], one), (TORCHRUN, two)):
        p = subprocess.run(cmd + [os.path.join(HERE, "tiny.py"), tiny_dir, out], cwd=HERE, capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
    one, two = torch.load(one), torch.load(two)
    assert list(one) == tiny.CONFIGS
    for config in tiny.CONFIGS:
        assert_same_update(one[config]["update"], two[config]["update"])
        assert max(u.abs().max() for u in one[config]["update"].values()) > 1e-4
        for k, v in one[config]["metrics"].items():
            assert two[config]["metrics"][k] == pytest.approx(v, rel=1e-4, abs=1e-6), (config, k)


TWO_RANKS_REWARD = """import atexit, os, shutil, sys, time
def r(c, a, **kw):  # held_judge's reward, without the hold
    return len(c) % 3
if {straight!r} in sys.argv and os.environ["RANK"] == "0":  # a slow disk: rank 0's saves take 2 s
    save = sys.modules["__main__"].save
    def slow_save(*args):
        time.sleep(2)
        save(*args)
    sys.modules["__main__"].save = slow_save
if {straight!r} in sys.argv and os.environ["RANK"] == "1":  # rank 1 copies the checkpoint's step as it leaves
    atexit.register(shutil.copy, {straight!r} + "/checkpoint/grpo_args.json", {left!r})
"""


RANKS = """
import dataclasses, itertools, json, os, sys
sys.path.insert(0, sys.argv[1])
import torch
import grpo

here, model_dir, data, out, saved = sys.argv[1:]
rank, world, device = grpo.setup_distributed()
grpo.setup_distributed = lambda: (rank, world, device)  # grpo.main() below joins this process group
result = {}
if world > 1:  # refused in one line, on every rank, before anything is written
    for name, argv in (("resume", ["--output-dir", saved, "--resume", "--max-steps", "2"]),
                       ("divide", ["--model", model_dir, "--output-dir", out + "/odd", "--prompts-per-step", "3"])):
        try:
            grpo.main(argv)
        except SystemExit as e:
            result[name] = str(e)
EQ = [1.0, 1.0]  # an all-equal group; the rest differ, each with its own std
SCHEDULES = {  # rewards by place in the data order: 4 prompts a round, slots 0 and 2 on rank 0, 1 and 3 on rank 1
    "exact": [[0, 1], EQ, [0, 3], EQ, [0, 2], EQ, [0, 4], EQ, EQ, [0, 5], EQ, [0, 6]],  # 2 kept on rank 0, then 2
    "overshoot": [EQ, [0, 1], EQ, [0, 3], [0, 2], [0, 5], [0, 4], [0, 6]]}  # 2 kept, then 4 more: cut to B
a = grpo.parse_args(["--model", model_dir, "--dataset", data, "--prompts-per-step", "4", "--num-generations", "2",
                     "--max-new-tokens", "4", "--dynamic-sampling", "--max-gen-rounds", "3", "--top-k-groups", "3",
                     "--soft-reweight", "--scale", "none", "--opsm-delta", "0.5", "--tis", "2", "--tis-mode",
                     "token_mask", "--top-entropy-quantile", "0.5",  # the filters count what they drop
                     "--tools", "calculator", "--kl-in-reward", "0.05", "--kl-target", "0.1"])  # (β: a state)
torch.manual_seed(0)
model, tok, _ = grpo.load_model(a, device)
train, _ = grpo.load_data(a)
real, drawn = grpo.generate, []
def recording(model, tok, rows, a, greedy=False, **kw):  # what each rank's evaluation draws: prompts, completions
    out = real(model, tok, rows, a, greedy=greedy, **kw)
    drawn.append([greedy, len({id(r["record"]) for r in rows}), [r["completion"].tolist() for r in out]])
    return out
grpo.generate = recording  # the model's own samples, of 4 copies of one prompt: 2 on each of 2 ranks
scores = grpo.evaluate(model, tok, [dict(train[0]) for _ in range(4)], dataclasses.replace(a, eval_samples=2), rank,
                       world)
result["sampled"] = [scores, grpo.all_gather(drawn)]
grpo.generate = real
torch.manual_seed(1000 * rank)
for case, schedule in SCHEDULES.items():
    order = [ex["prompt"] for ex in itertools.islice(grpo.prompt_stream(train, a.seed), len(schedule))]
    table, calls = dict(zip(order, schedule)), {}
    def reward(completion, answer, prompt, **kw):  # the k-th completion of a prompt, whatever its text
        calls[prompt] = calls.get(prompt, -1) + 1
        return float(table[prompt][calls[prompt] % 2])
    kept, stats, _ = grpo.rollout(model, tok, grpo.prompt_stream(train, a.seed), [("r", reward, 1.0)], None, a,
                                  {"prompts_drawn": 0}, None, rank, world)
    if stats["groups/kept"]:  # the advantages, as the step makes them
        stats.update(grpo.prepare(model, None, kept, a, {})[-1])
    mine = {}  # a kept group's prompt, rewards, advantages
    for r in kept:
        g = mine.setdefault(r["order"], [r["record"]["prompt"], [], []])
        g[1].append(r["reward"])
        g[2].append(r["adv"])
    groups = sum(grpo.all_gather(list(mine.values())), [])
    result[case] = [sorted(groups), {k: v for k, v in stats.items() if k.startswith(("groups/kept", "groups/gen",
                                                                                      "adv/"))}]
def generate(model, tok, rows, a, greedy=False, sampler=None, tools=None):  # completions set by a prompt's k
    for i, r in enumerate(rows):  # the j-th row of prompt k
        k = int(r["record"]["prompt"].split("Question ")[1].split("?")[0])
        j = [q["record"] for q in rows[:i]].count(r["record"])
        comp = tok(f"\\boxed{{{k % 3 if greedy else (k + j) % 2}}}" + " so" * (k % 4 + j), add_special_tokens=False
                   ).input_ids + [tok.eos_token_id] * ((k + j) % 3 > 0)  # (k + j) % 3 == 0: truncated
        odd = places.index(f"Question {k}?") % 2  # its place in a round: odd on rank 1 of 2
        called = (k + j) % 2 * (1 + odd)  # calls: twice as many on rank 1 of 2; their results: the completion's 3rd
        mask = torch.tensor([float(not called or t not in (2, 3)) for t in range(len(comp))])  # and 4th tokens
        r.update(prompt_ids=torch.tensor(tok(grpo.prompt_text(tok, r["record"], a, tools), add_special_tokens=False
                                             ).input_ids), completion=torch.tensor(comp), truncated=(k + j) % 3 == 0,
                 logp=torch.full((len(comp),), -30.0 * odd), tool_mask=mask,  # the sampler's: 30 nat off on rank 1
                 tool_calls=[{"name": "calculator", "arguments": {}, "result": "1",
                              **({"error": True} if k % 4 == 1 else {})}] * called,
                 text=tok.decode(torch.tensor(comp)[mask > 0], skip_special_tokens=True))  # the model's tokens
    return rows
def graded(completion, answer, prompt, tool_calls, **kw):  # prompts 3, 6, ...: an equal-reward group
    return 0.5 if int(prompt.split()[1][:-1]) % 3 == 0 else float(grpo.is_correct(completion, answer)) + len(tool_calls)
grpo.generate = generate  # every rank's rows in the step's metrics and in the evaluation, as one process has them
places = [ex["prompt"] for ex in itertools.islice(grpo.prompt_stream(train, a.seed), 40)]
kept, stats, _ = grpo.rollout(model, tok, grpo.prompt_stream(train, a.seed), [("graded", graded, 1.0)], None, a,
                              {"prompts_drawn": 0}, None, rank, world)
stats.update(grpo.train_step(model, None, torch.optim.SGD(model.parameters(), lr=0.0), kept, a))
result["metrics"] = {k: v for k, v in stats.items() if not k.startswith("time/")}
result["eval"] = grpo.evaluate(model, tok, train[:10], dataclasses.replace(a, eval_samples=2), rank, world)
if rank == 0:
    with open(out + ".json", "w") as f:
        json.dump(result, f)
if world > 1:  # both done; then out without gloo's teardown, which aborted a rank at exit 1 run in ~10 under load
    torch.distributed.barrier()
    os._exit(0)
"""


def test_two_processes_filter_as_one_and_refuse_what_they_cannot_run(tiny_dir, tmp_path):
    """Dynamic sampling (kept groups counted over the ranks), top-k over every rank's groups and soft reweighting
    by the largest std among them: a rollout on 2 ranks keeps the groups that one process keeps, with the same
    advantages (rewards set by each prompt's place in the data order, whatever was sampled); with completions set
    by each prompt (a stub of the sampler, some rows calling tools: --tools), every metric of the step (rollout's,
    tools/ among them, train_step's on the tool-masked tokens) and of the evaluation is the one process's, from
    every rank's rows (rank 0's alone give others). And under torchrun,
    --resume of a one-process run and a --prompts-per-step that does not divide over the ranks are refused in
    one line, before anything is written."""
    data = write(tmp_path / "data.jsonl", [json.dumps({"prompt": f"Question {i}?", "answer": "1"}) for i in range(40)])
    saved = str(tmp_path / "saved")
    main(["--model", tiny_dir, "--output-dir", saved, "--max-steps", "1", "--eval-every", "0"] + TINY)
    before = (tmp_path / "saved" / "metrics.jsonl").read_text()
    (tmp_path / "ranks.py").write_text(RANKS)
    for name, cmd in (("one", [sys.executable]), ("two", TORCHRUN)):
        p = subprocess.run(cmd + [str(tmp_path / "ranks.py"), HERE, tiny_dir, data, str(tmp_path / name), saved],
                           cwd=HERE, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
    one, two = (json.load(open(tmp_path / f"{name}.json")) for name in ("one", "two"))
    assert two.pop("resume") == "grpo: error: --resume: the saved run ran on 1 processes, this one on 2"
    assert two.pop("divide").startswith("grpo: error: --prompts-per-step 3 must divide over 2 ranks")
    assert not (tmp_path / "two" / "odd").exists() and (tmp_path / "saved" / "metrics.jsonl").read_text() == before
    groups, stats = one["exact"]
    assert stats == pytest.approx({"groups/kept": 3, "groups/gen_rounds": 2, "adv/soft_weight_min": 0.5,
                                   "adv/soft_weight_mean": 0.75, "adv/soft_weight_max": 1.0}, rel=1e-5)
    kept = sorted((r, adv) for _, r, adv in groups)  # the top 3 by std, A = (R - mean) w
    assert [r for r, _ in kept] == [[0, 2], [0, 3], [0, 4]]
    assert [adv for _, adv in kept] == [pytest.approx([-x, x], rel=1e-5) for x in (1 * 0.5, 1.5 * 0.75, 2 * 1.0)]

    def same(x, y):  # the same groups, rewards, advantages and metrics (to float rounding)
        return [g[:2] for g in x[0]] == [g[:2] for g in y[0]] and x[1] == pytest.approx(y[1], rel=1e-5) and \
            sum((g[2] for g in x[0]), []) == pytest.approx(sum((g[2] for g in y[0]), []), rel=1e-5)
    assert same(two["exact"], one["exact"]), (two["exact"], one["exact"])
    assert same(two["overshoot"], one["overshoot"]), (two["overshoot"], one["overshoot"])  # the cut to B
    # completions set by each prompt (a sampler stub): every metric of the step and the evaluation is one process's
    assert two["metrics"] == pytest.approx(one["metrics"], rel=1e-5), one["metrics"]  # the same keys, the same values
    assert two["eval"] == pytest.approx(one["eval"]) and one["eval"]["eval/accuracy"] == 0.3  # k % 3 == 1 of 0-9
    m = one["metrics"]
    assert 0 < m["groups/equal_frac"] < 1 and 0 < m["accuracy"] < 1 and 0 < m["completion/truncated_frac"] < 1
    assert m["sampler/logp_gap_max"] > 20 and m["train/rows"] == 6  # the largest gap: on rank 1
    assert all(0 < m[f"loss/{k}_frac"] < 1 for k in ("opsm", "tis", "low_entropy")), m  # (rank 0's rows, 1's)
    assert 0 < m["tools/call_frac"] < 1 and 0 < m["tools/errors"] < 1  # (--tools: the calls of every rank's rows)
    assert m["kl/in_reward_coef"] == 0.05  # a term with state: its first step's β, on both ranks as on one
    # the evaluation by the model's own samples: the prompts split over the ranks, each evaluated once (none
    # twice, none left out), each rank drawing its own samples (of one prompt, so that ranks that drew alike
    # would show it), and the greedy accuracy the one process's (the sampled scores differ, the draws being others)
    for run, world in ((one, 1), (two, 2)):
        drawn = run["sampled"][1]
        assert len(drawn) == world and all(len(calls) == 2 for calls in drawn)  # a greedy call, a sampled one
        assert sum(n for calls in drawn for greedy, n, _ in calls if greedy) == 4
        assert sum(n for calls in drawn for greedy, n, _ in calls if not greedy) == 4
        assert sum(len(comps) for calls in drawn for greedy, _, comps in calls if not greedy) == 4 * 2
    greedy, sampled = ([comps for calls in two["sampled"][1] for g, _, comps in calls if g == want] for want in (1, 0))
    assert greedy[0] == greedy[1] and sampled[0] != sampled[1]
    assert two["sampled"][0]["eval/accuracy"] == one["sampled"][0]["eval/accuracy"]


def test_two_processes_mixed_pool_refill_sigterm_and_resume(tiny_dir, tmp_path):
    """2 ranks, DAPO's refill in mixed-pool mode: one metrics file and checkpoint (rank 0). The ranks leave
    together: rank 1 waits for rank 0's last save (one that leaves sooner may die at exit). SIGTERM to torchrun
    (which forwards it to every rank and kills them 30 s later) during a rollout: rank 0 saves the last completed
    step at once, and --resume from it to step 3 gives the straight 3-step run, bit for bit (each rank's random
    states and teacher draws restored)."""
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    left = tmp_path / "left.json"
    (tmp_path / "rw.py").write_text(TWO_RANKS_REWARD.format(straight=straight, left=str(left)))
    args = [os.path.join(HERE, "grpo.py"), "--algo", "dapo", "--model", tiny_dir, "--teacher-per-group", "2",
            "--split-grads", "--max-gen-rounds", "2", "--max-steps", "3", "--rewards", "correct"] + NO_EVAL \
        + ["--log-samples", "4"] + mixed_files(tmp_path)  # every group of 2 rounds of B = 2
    subprocess.run(TORCHRUN + args + ["--reward-fn", f"{tmp_path}/rw.py:r", "--output-dir", straight], cwd=HERE,
                   check=True, capture_output=True)
    args += held_judge(tmp_path, split, after=1)  # once step 1 is logged, step 2's rollout is held
    assert left.exists() and json.loads(left.read_text())["step"] == 3, "rank 1 left before rank 0's last save"
    rows = metrics(straight)
    assert [r["step"] for r in rows] == [1, 2, 3]  # one file, written by rank 0 alone
    assert all(r["groups/kept"] <= 2 and "grad/cos_student_teacher" in r for r in rows if r["groups/kept"])
    samples = [json.loads(line) for line in open(straight + "/samples.jsonl")]
    answers = {f"What is {i} + {i}?": str(2 * i) for i in range(4)}  # mixed_files'
    for m in rows:  # every rank's completions logged, and the step's metrics are theirs (not rank 0's alone)
        step = [r for r in samples if r["step"] == m["step"]]
        students = [r for r in step if not r["teacher"]]
        assert len(step) == m["groups/gen_rounds"] * 2 * (4 + 2) and len({r["prompt"] for r in step}) > 1
        assert m["reward/mean"] == pytest.approx(statistics.mean(r["reward"] for r in step), abs=1e-6)
        assert m["reward/mean_teacher"] == pytest.approx(statistics.mean(r["reward"] for r in step if r["teacher"]))
        assert m["completion/tokens"] == sum(r["length"] for r in students)
        assert m["accuracy"] == statistics.mean(R.correct(r["completion"], answers[r["prompt"]]) for r in students)
    (tmp_path / "hold").touch()
    p = background(tmp_path, TORCHRUN + args + ["--output-dir", split])
    try:
        wait_for("held judge on rank 0", (tmp_path / "held0").exists, p)
        p.send_signal(signal.SIGTERM)  # torchrun forwards it to every rank
        wait_for("rank 0's stop", lambda: "grpo: stopped at step" in p.out(), p)
        (tmp_path / "hold").unlink()  # rank 1 goes on, finds rank 0 gone, and ends
        p.wait(timeout=120)
    finally:
        (tmp_path / "hold").unlink(missing_ok=True)
        p.kill()
    assert "Unable to shutdown process" not in p.err(), p.err()[-3000:]  # no rank was left for torchrun to kill
    step = json.load(open(split + "/checkpoint/grpo_args.json"))["step"]
    assert step == metrics(split)[-1]["step"] == 1
    cli(["--output-dir", split, "--resume"], cmd=TORCHRUN)
    assert steady(metrics(split)) == steady(rows)
    assert [json.loads(line) for line in open(split + "/samples.jsonl")] == samples  # every rank's, as they were
    a, b = trained(straight), trained(split)
    assert all(torch.equal(a[k], b[k]) for k in a)


REQUEUED = """import json, os, pathlib, sys
sys.path.insert(0, {here!r})
import grpo
setup, start = grpo.setup_distributed, grpo.start
def joined():  # a rank joins the process group: a file the test waits on
    pathlib.Path({notes!r} + "joined" + os.environ.get("RANK", "0")).touch()
    return setup()
def started(a):  # the flags a rank starts with
    pathlib.Path({notes!r} + "flags" + os.environ.get("RANK", "0")).write_text(json.dumps(vars(a)))
    return start(a)
grpo.setup_distributed, grpo.start = joined, started
grpo.main()
"""


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_requeued_job_that_meets_its_old_one_before_its_first_save_continues_from_that_save(loaded, tiny_dir,
                                                                                               tmp_path, ranks):
    """A requeued job (`--resume auto`, its first launch's command) meets its old job still running, before that
    one's first save: the old job (here, this process) holds the output dir's lock. The new job waits, every rank
    of it (rank 0 for the lock, the others for what rank 0 then reads), so when the old job saves step 2 and ends,
    each rank continues from step 2, with that checkpoint's flags, rather than start over and delete it (rank 1,
    reading the dir alone before the save, once did)."""
    a, model, tok = loaded
    out = tmp_path / "out"
    out.mkdir()
    old = open(out / ".lock", "a")
    fcntl.flock(old, fcntl.LOCK_EX)  # the old job, in its step 2
    (out / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    (tmp_path / "requeued.py").write_text(REQUEUED.format(here=HERE, notes=f"{tmp_path}/"))
    cmd = [sys.executable] if ranks == 1 else TORCHRUN
    p = background(tmp_path, cmd + [str(tmp_path / "requeued.py"), "--model", tiny_dir, "--algo", "drgrpo",
                                    "--output-dir", str(out), "--resume", "auto", "--max-steps", "3"]
                   + TINY + ["--eval-every", "0"])
    try:
        wait_for("rank 0's wait", lambda: f"'{out}' is in use by another run: waiting for it to end" in p.err(), p)
        wait_for("rank 1", lambda: all((tmp_path / f"joined{r}").exists() for r in range(1, ranks)), p)
        with open(out / "metrics.jsonl", "a") as f:
            f.write('{"step": 2, "reward/mean": 0.25}\n')
        rng = {"torch": torch.get_rng_state(), "cuda": None, "python": grpo.random.getstate()}
        grpo.save(model, tok, replace(a, output_dir=str(out), seed=7),  # (a seed the new command does not give)
                  {"step": 2, "prompts_drawn": 4, "rng": [rng] * ranks,
                   "optimizer": grpo.make_optimizer(a, model).state_dict()})
        old.close()  # the old job ends
        wait_for("every rank's start", lambda: all((tmp_path / f"flags{r}").exists() for r in range(ranks)), p)
        flags = [json.loads((tmp_path / f"flags{r}").read_text()) for r in range(ranks)]
        assert all(f == flags[0] for f in flags), [(f["resume"], f["overwrite"], f["seed"]) for f in flags]
        assert flags[0]["resume"] == "on" and flags[0]["seed"] == 7
        assert p.wait(timeout=240) == 0, p.err()[-3000:]
    finally:
        old.close()
        p.kill()
    assert [r["step"] for r in metrics(str(out))] == [1, 2, 3] and metrics(str(out))[1]["reward/mean"] == 0.25
    assert json.load(open(out / "checkpoint" / "grpo_args.json"))["step"] == 3


# ----------------------------------------------------------------------------- does it learn?
def test_reward_rises_on_a_toy_task(tmp_path):
    """An honest learning check (bench/learn.py, shortened and seeded): a tiny model after a short supervised
    warm-up on 'a+b=' is trained by grpo.py (Dr. GRPO) for 100 steps; the sampled reward (= accuracy) of the last
    20 steps beats the first 10 by a clear margin. Float rounding moves the margin as a seed does (another
    machine warms up another model): over seeds 0-5 it was 0.26 0.28 0.35 0.25 0.25 0.36 here, and with one thread
    a process, as the suite runs, 0.28 0.27 0.34 0.30 0.28 0.33. At 60 steps
    (last 10 against first 10: 0.20 to 0.24 here) a 0.2 margin failed on a machine that gave 0.15. 0.1 leaves
    the worst seed 2.5 times the room, while a run that does not learn (learning rate 1e-12) moved it by 0.02."""
    sys.path.insert(0, os.path.join(HERE, "bench"))
    import learn
    data = learn.task()
    model = str(tmp_path / "warm")
    learn.warmup(model, data, steps=200)
    path = write(tmp_path / "task.jsonl", [json.dumps(d) for d in data])
    rows, _ = learn.run(str(tmp_path / "out"), model, path, 100, ["--algo", "drgrpo"])
    reward = [r["reward/mean"] for r in rows]
    start, end = sum(reward[:10]) / 10, sum(reward[-20:]) / 20
    assert end - start > 0.1, (start, end)
