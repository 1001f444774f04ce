"""rewards.py as of commit 8a07fed (before issue 11), kept only as the baseline bench/grading.py compares against."""
import re
from fractions import Fraction

MAX_DIGITS = 40  # longer numbers are not answers; also keeps Fraction() cheap

# ------------------------------------------------------------------------------ extraction
_NUM = re.compile(r"[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:\s*/\s*\d+)?")
_FRAC = re.compile(r"\\d?frac\{([^{}]{1,50})\}\{([^{}]{1,50})\}")
_HASHES = re.compile(r"####\s*([^\n]{1,200})")
_THE_ANSWER = re.compile(r"answer is\s*:?\s*([^\n]{1,200})", re.I)
_A_COLON = re.compile(r"(?:^|\n)[ \t]*A[ \t]*:[ \t]*([^\n]{1,200})")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces matched by a linear scan."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, min(len(text), i + 1000)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def last_answer_tag(text: str) -> str | None:
    """Content of the last <answer>...</answer>."""
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, max(end, 0))
    return text[start + len("<answer>"):end] if 0 <= start < end else None


def extract_answer(text: str) -> str | None:
    """The final answer's text, by the first rule that matches:
    \\boxed{}, <answer>...</answer>, '#### N', 'the answer is N', 'A: N', else the last number."""
    found = last_boxed(text)
    found = last_answer_tag(text) if found is None else found
    for pattern in (_HASHES, _THE_ANSWER, _A_COLON):
        if found is not None:
            break
        matches = pattern.findall(text)
        found = matches[-1] if matches else None
    if found is not None:
        return found
    last = None
    for last in _NUM.finditer(text):
        pass
    return last.group(0) if last else None


def to_number(text: str | None) -> Fraction | None:
    """The first number in an answer's text, exactly, or None.
    Normalises commas, $, %, units and words around it, trailing '.0', a/b and \\frac{a}{b}."""
    if text is None:
        return None
    text = _FRAC.sub(r"\1/\2", text[:1000]).replace("\\$", "").replace("$", "")
    m = _NUM.search(text)
    if m is None:
        return None
    num = m.group(0).replace(",", "").replace(" ", "")
    if sum(c.isdigit() for c in num) > MAX_DIGITS:
        return None
    try:
        return Fraction(num)  # exact: '0.75' == '3/4', '18.0' == '18'
    except (ValueError, ZeroDivisionError):
        return None


def reference_answer(answer: str) -> str:
    """GSM8K's answer field ends in '#### N': the reference is N. Other answers pass through."""
    m = _HASHES.findall(answer)
    return m[-1].strip() if m else answer.strip()


# ------------------------------------------------------------------------------ rewards
def is_correct(completion: str, answer: str) -> bool:
    pred, ref = to_number(extract_answer(completion)), to_number(answer)
    return pred is not None and pred == ref


def correct(completion: str, answer: str, **kw) -> float:
    """1 if the extracted final answer equals the reference numerically, else 0."""
    return 1.0 if is_correct(completion, answer) else 0.0


def correct_pm1(completion: str, answer: str, **kw) -> float:
    """DAPO (2503.14476) §2.4 rule-based reward: +1 if correct, -1 otherwise."""
    return 1.0 if is_correct(completion, answer) else -1.0


def r1_format(completion: str, answer: str, **kw) -> float:
    """DeepSeek-R1 (2501.12948) format reward: '<think>...</think><answer>...</answer>' and nothing else.
    (The regex ^<think>.*?</think>\\s*<answer>.*?</answer>$, written as linear scans.)"""
    s = completion.strip()
    ok = s.startswith("<think>") and s.endswith("</answer>") and re.search(r"</think>\s*<answer>", s)
    return 1.0 if ok else 0.0


REWARDS = {"correct": correct, "correct_pm1": correct_pm1, "format": r1_format}


def overlong_penalty(length: int, max_len: int, buffer: int) -> float:
    """DAPO (2503.14476) §3.4 soft overlong punishment, eq. 13, with L_max = max_len, L_cache = buffer:
    0 up to max_len - buffer tokens, then falling linearly to -1 at max_len, -1 beyond."""
    if length <= max_len - buffer:
        return 0.0
    if length <= max_len:
        return ((max_len - buffer) - length) / buffer
    return -1.0
