"""How well `rewards.correct` grades, against labels: agreement, false positives, false negatives.

    python bench/grading.py          # add a math_verify column where `pip install math-verify` is done

GSM8K: bench/data/gsm8k_model_solutions.jsonl holds the first 8 problems of openai/grade-school-math's
example_model_solutions.jsonl (MIT): the reference solution and four GPT-3 solutions each (6B and 175B,
fine-tuned and verifier-picked), with OpenAI's is_correct labels; the one cut-off solution is abridged.
Each solution's final 'A: N' line is rewritten the ways models write a final answer (\\boxed{}, 'the
answer is', ####, R1 tags, LaTeX separators, a new question after the answer, ...); the label stays.
MATH: real MATH-style answers (fractions, radicals, pi, intervals, tuples, expressions, mixed numbers,
choices), each right in several equivalent writings and wrong in near misses; labelled by construction.
The baseline is rewards.py before issue 11, read from git history (commit 8a07fed).
"""
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import rewards  # noqa: E402


def baseline():
    """rewards.py as it was before issue 11 (commit 8a07fed), from this clone's git history; None outside a full
    git clone (a shallow clone, a copy, a zip), where the table leaves that column out."""
    p = subprocess.run(["git", "-C", ROOT, "show", "8a07fed:rewards.py"], capture_output=True, text=True)
    if p.returncode:
        print(f"bench/grading.py: no baseline column: git cannot read 8a07fed:rewards.py here "
              f"({(p.stderr.strip().splitlines() or ['?'])[-1]})", file=sys.stderr)
        return None
    src = p.stdout
    module = types.ModuleType("rewards_8a07fed")
    exec(compile(src, "rewards.py@8a07fed", "exec"), module.__dict__)  # our own earlier source, not model text
    return module


def latex_thousands(x: str) -> str:
    return re.sub(r"\B(?=(\d{3})+(?!\d))", "{,}", x)


GSM8K_STYLES = {  # body (the reasoning), X (the solution's own final answer) -> a completion
    "A: N (as written)": lambda body, x: f"{body}\nA: {x}",
    "#### N": lambda body, x: f"{body}\n#### {x}",
    "the answer is N.": lambda body, x: f"{body}\nThe answer is {x}.",
    "\\boxed{N}": lambda body, x: f"{body}\nTherefore, the final answer is $\\boxed{{{x}}}$.",
    "<think>/<answer>": lambda body, x: f"<think>\n{body}\n</think>\n<answer>{x}</answer>",
    "boxed inside <think>, <answer> after": lambda body, x: f"<think>\n{body} so maybe \\boxed{{{x}1}}\n</think>\n"
                                                          f"<answer>{x}</answer>",
    "\\boxed{} with {,} separators": lambda body, x: f"{body}\nSo the answer is $\\boxed{{{latex_thousands(x)}}}$.",
    "answer is $N$ dollars, then more": lambda body, x: f"{body}\nThe answer is ${x}$ dollars. That is 2 more than "
                                                       f"last week's 3.",
    "answer, then a new question": lambda body, x: f"{body}\nThe answer is {x}.\n\nQ: Tom has 4 boxes of 10 pencils. "
                                                   f"How many pencils does he have?\nA: 4 * 10 = 40 pencils",
    "a = b chain in the answer": lambda body, x: f"{body}\nThe answer is 1 + {x} - 1 = {x}.",
    "**Final Answer:** N": lambda body, x: f"{body}\n\n**Final Answer:** {x}",
    "Minerva: final answer is $N$. I hope": lambda body, x: f"{body}\nFinal Answer: The final answer is ${x}$. I hope "
                                                            f"it is correct.",
}

MATH = [  # reference, writings that are right, writings that are wrong
    ("\\frac{3}{4}", ["\\frac34", "\\dfrac{3}{4}", "0.75", "3/4", "\\left(\\frac{3}{4}\\right)"], ["\\frac{4}{3}", "0.7", "3"]),
    ("12\\frac{3}{5}", ["12 \\frac{3}{5}", "\\frac{63}{5}", "12.6"], ["\\frac{123}{5}", "12", "3/5"]),
    ("10{,}000", ["10,000", "10000", "10\\,000"], ["10", "1000"]),
    ("2\\sqrt{3}", ["2 \\sqrt{3}", "2\\sqrt3"], ["3\\sqrt{2}", "2", "\\sqrt{3}"]),
    ("\\frac{\\pi}{2}", ["\\dfrac{\\pi}{2}", "\\pi/2"], ["\\pi", "\\frac{\\pi}{3}", "2"]),
    ("(2, 3)", ["(2,3)", "\\left(2, 3\\right)"], ["(3, 2)", "2", "(2, 4)"]),
    ("[0, 1)", ["[0,1)", "\\left[0, 1\\right)"], ["[0, 1]", "(0, 1)", "0"]),
    ("x^2+1", ["x^2 + 1", "x^{2}+1"], ["x^2+2", "x^2", "1"]),
    ("4a-2", ["4a - 2", "4a-2"], ["4a-3", "4", "2"]),
    ("-\\frac{1}{2}", ["-0.5", "-1/2", "\\frac{-1}{2}"], ["\\frac{1}{2}", "-2", "1"]),
    ("\\text{(C)}", ["C", "(C)", "\\text{(C)}"], ["B", "(D)", "3"]),
    ("B", ["B", "(B)", "\\textbf{(B)}"], ["A", "C", "2"]),
    ("90^\\circ", ["90", "90^{\\circ}", "90°"], ["45", "180^\\circ"]),
    ("25\\%", ["25", "25%"], ["0.5", "52"]),
    ("\\$1,250", ["1250", "\\$1{,}250", "1,250 dollars"], ["125", "1,205"]),
    ("\\text{Tuesday}", ["Tuesday", "\\text{Tuesday}"], ["Monday", "\\text{Thursday}"]),
    ("5", ["x = 5", "5", "5.0"], ["-5", "x = 6", "25"]),
    ("18", ["9 \\times 2 = 18", "18"], ["9 \\times 2", "9"]),
]
MATH_STYLES = {
    "\\boxed{}": lambda x: f"Putting it together, the answer is $\\boxed{{{x}}}$.",
    "the answer is $X$.": lambda x: f"So the answer is ${x}$. We can check this by substitution.",
    "<answer>": lambda x: f"<think>We try \\boxed{{0}} first, then fix it.</think><answer>{x}</answer>",
}


def cases():
    """(source, style, completion, reference, label)."""
    for row in map(json.loads, open(os.path.join(os.path.dirname(__file__), "data", "gsm8k_model_solutions.jsonl"))):
        for text, label in row["solutions"]:
            body, _, x = text.rpartition("\nA: ")
            if not body:  # cut off before its answer
                yield "gsm8k", "cut off (no answer)", text, row["answer"], label
                continue
            for style, write in GSM8K_STYLES.items():
                yield "gsm8k", style, write(body, x), row["answer"], label
    for ref, right, wrong in MATH:
        for style, write in MATH_STYLES.items():
            yield from (("math", style, write(x), ref, True) for x in right)
            yield from (("math", style, write(x), ref, False) for x in wrong)


def rates(grades, labels):
    """agreement, false-positive rate (wrong graded right / wrong), false-negative rate (right graded wrong / right)."""
    pos = [g for g, y in zip(grades, labels) if y]
    neg = [g for g, y in zip(grades, labels) if not y]
    agree = sum(g == y for g, y in zip(grades, labels)) / len(labels)
    return agree, sum(neg) / max(1, len(neg)), (len(pos) - sum(pos)) / max(1, len(pos))


def main():
    old = baseline()
    graders = {**({"before (8a07fed)": old.is_correct} if old else {}), "correct (now)": rewards.is_correct}
    if importlib.util.find_spec("math_verify"):
        graders["math_verify"] = lambda c, a: rewards.math_verify(c, a) == 1.0
    all_cases = list(cases())
    grades, seconds = {}, {}
    for name, fn in graders.items():
        t0 = time.time()
        grades[name] = [bool(fn(c, ref)) for _, _, c, ref, _ in all_cases]
        seconds[name] = (time.time() - t0) / len(all_cases)
    labels = [y for *_, y in all_cases]
    print(f"{len(all_cases)} labelled completions: {sum(labels)} right, {len(labels) - sum(labels)} wrong\n")
    print("| set | n | " + " | ".join(f"{name}: agree / FP / FN" for name in graders) + " |")
    print("| --- | --- |" + " --- |" * len(graders))
    groups = [("all", lambda s: True), ("gsm8k", lambda s: s[0] == "gsm8k"), ("math", lambda s: s[0] == "math")]
    groups += [(f"gsm8k: {style}", lambda s, st=style: s[:2] == ("gsm8k", st)) for style in GSM8K_STYLES]
    for title, keep in groups:
        idx = [i for i, s in enumerate(all_cases) if keep(s)]
        cells = []
        for name in graders:
            a, fp, fn = rates([grades[name][i] for i in idx], [labels[i] for i in idx])
            cells.append(f"{a:.1%} / {fp:.1%} / {fn:.1%}")
        print(f"| {title} | {len(idx)} | " + " | ".join(cells) + " |")
    print("\nms per completion: " + ", ".join(f"{name} {1000 * s:.2f}" for name, s in seconds.items()))
    if "math_verify" in graders:
        adversarial = {"1 MB of digits": "9" * 1_000_000, "\\boxed{ x 10,000": "\\boxed{" * 10_000,
                       "100k nested braces": "\\boxed{" + "{" * 100_000, "power tower": "\\boxed{9^{9^{9^{9^{9}}}}}",
                       "2^{10^{10}}": "\\boxed{2^{10^{10}}}"}
        print("\nadversarial texts, seconds (correct / math_verify):")
        for name, text in adversarial.items():
            row = []
            for fn in (rewards.correct, rewards.math_verify):
                t0 = time.time()
                value = fn(text, "42")
                row.append(f"{time.time() - t0:.3f} s -> {value}")
            print(f"  {name}: " + " / ".join(row))
    wrong_now = [(s, g) for s, g, y in zip(all_cases, grades["correct (now)"], labels) if g != y]
    print(f"\ncorrect (now) disagrees with the label on {len(wrong_now)}:")
    for (src, style, c, ref, y), g in wrong_now[:20]:
        print(f"  [{src} | {style}] label {y}, graded {g}, reference {ref!r}: ...{c[-90:]!r}")


if __name__ == "__main__":
    main()
