"""Reward functions for grpo.py: answer extraction, math correctness, format, length-scaled
correctness (cosine), n-gram repetition, DAPO's overlong penalty; a reward model (`reward_model`, --reward-model);
and `calculator`, the built-in tool (--tools).

A reward is `fn(completion: str, answer: str, **kw) -> float`: the completion text
(special tokens stripped), the reference answer (for GSM8K the number after `####`),
and as keywords `length` (the completion's tokens, its EOS included), `max_length`
(T = --max-new-tokens) and the data record's other fields. A keyword-only parameter
with a default (after `*`: `max_penalty` below), but for those grpo.py passes, is
the reward's own setting: a record with a field of that name is refused, never
passed to it. `REWARDS` maps the names that `--rewards correct:1,format:0.2` accepts
to these functions. Add yours there, or pass `--reward-fn my_file.py:my_fn` without
touching this file. A reward that grades against the answer is marked
`@reads_answer`: grpo.py then refuses records whose answer is empty. A reward model
is a sequence classifier (`reward_model`, the reward `model` with `--reward-model
ID_OR_PATH`): marked `batched`, it scores all of a step's completions in one call,
as TRL's does.

Model text is never eval'd or exec'd (the calculator walks Python's parse tree). Every regex here is linear-time and
every answer and number is capped in length, so adversarial text (megabytes of
digits, nested braces, unicode) returns a finite float quickly. The standard
library only; `math_verify` (optional) imports its package when first called,
`reward_model` torch and transformers.
"""
import ast
import math
import operator
import re
from fractions import Fraction

MAX_DIGITS = 40  # longer numbers are not answers; also keeps Fraction() cheap
MAX_ANSWER = 300  # characters: an answer span longer than this is not one answer

# ------------------------------------------------------------------------------ extraction
# A number as written: 1,234,567 | 1234 | 12.5 | .5 (thousands commas only in groups of three)
_N = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
_ANY_NUMBER = re.compile(rf"[-+−]?(?:{_N})(?:\s*/\s*\d+)?")  # − (U+2212): clean() makes it -
# A whole answer that is one number: sign, currency, an optional whole part of a mixed number, a/b,
# then %, or a unit (a word of 2+ letters, or any word after a space, maybe ^2: '12cm', '5 m^2', not '4a')
_NUMBER_ANSWER = re.compile(rf"(?P<sign>[-+]?)\s*(?:[$€£¥₹]\s*)?(?:(?P<whole>\d+)\s+(?=\d+\s*/))?(?P<num>{_N})"
                            rf"(?:\s*/\s*(?P<den>{_N}))?\s*(?:%|(?:[a-zA-Z]{{2,}}|\s[a-zA-Z])(?:[a-zA-Z\s./]|\^\{{?\d\}}?)*)?")
_LATEX_FRAC = re.compile(r"\\[dt]?frac\s*(?:\{\s*([^{}]{1,50}?)\s*\}|(\d))\s*(?:\{\s*([^{}]{1,50}?)\s*\}|(\d))")
_TEXT_CMD = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]{0,100})\}")
_HASHES = re.compile(r"####\s*([^\n]{1,200})")
_PHRASE = re.compile(r"(?:answer\s*(?:is|:|=)|(?:^|\n)[ \t]*A[ \t]*:)[ \t:]*([^\n]{1,300})", re.I)
_NEXT_QUESTION = re.compile(r"\n[ \t]*(?:Q|Question|Problem|Human|User)[ \t]*:", re.I)
_SENTENCE_END = re.compile(r"\.(?=\s|$)|\s\((?!\d)|,\s+(?:so|which|because|since|and)\b")
_CHOICE = re.compile(r"\(?([A-Ea-e])\)?(?:[.:)]|\s|$)")


def last_boxed(text: str) -> str | None:
    """Content of the last closed \\boxed{...} (or \\fbox{}), braces matched by a linear scan."""
    end = len(text)
    for _ in range(3):  # an unclosed last box (a cut-off completion): try the one before, a few times at most
        start = max(text.rfind("\\boxed{", 0, end), text.rfind("\\fbox{", 0, end))
        if start < 0:
            return None
        i = text.index("{", start) + 1
        depth = 1
        for j in range(i, min(len(text), i + 1000)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i:j]
        end = start
    return None


def last_answer_tag(text: str) -> str | None:
    """Content of the last <answer>...</answer>."""
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, max(end, 0))
    return text[start + len("<answer>"):end] if 0 <= start < end else None


def final_answer(text: str) -> tuple[str | None, str]:
    """The answer the completion gives last and means as final, and where it was found. In order:
    the last <answer> tag ("tag"), the last \\boxed{} ("boxed"), the last '#### N' ("hashes"), the last
    'answer is ...' / 'A: ...' up to the end of its sentence ("phrase"), each looked for first after the
    thinking (</think>) and in text cut before a new question the model went on to write; else the last
    number ("last")."""
    think = text.rfind("</think>")
    parts = [text[think + len("</think>"):], text] if think >= 0 else [text]
    for part in parts:
        next_q = _NEXT_QUESTION.search(part)
        if next_q and (_PHRASE.search(part, 0, next_q.start()) or "\\boxed" in part[:next_q.start()]):
            part = part[:next_q.start()]
        hashes = _HASHES.findall(part)
        for kind, found in (("tag", last_answer_tag(part)), ("boxed", last_boxed(part)),
                            ("hashes", hashes[-1] if hashes else None)):
            if found is not None:
                return found, kind
        phrase = None
        found = _PHRASE.search(part)
        while found:  # the last phrase, on the line of an earlier one too
            phrase = found.group(1)
            found = _PHRASE.search(part, found.start(1))
        if phrase:  # the sentence after the last phrase, not the reasoning that follows it
            cut = _SENTENCE_END.search(phrase, 1)
            return (phrase[:cut.start()] if cut else phrase), "phrase"
    return last_number(text), "last"


def last_number(text: str) -> str | None:
    last = None
    for last in _ANY_NUMBER.finditer(text):
        pass
    return last.group(0) if last else None


def clean(answer: str) -> str:
    """An answer's text without LaTeX dressing: $, \\( \\), \\left/\\right, spacing commands, \\text{...}
    kept as its words, {,} and \\, thousands separators, degrees, markdown bold; \\frac{a}{b} as a/b (a
    mixed number 12\\frac{3}{5} as '12 3/5'); the right-hand side of an a = b chain; no trailing period."""
    s = answer[:MAX_ANSWER]
    s = _TEXT_CMD.sub(lambda m: " " + m.group(1) + " ", s)
    for old, new in (("{,}", ","), ("\\,", ""), ("\\!", ""), ("\\;", " "), ("\\:", " "), ("\\ ", " "),
                     ("\\quad", " "), ("\\left", ""), ("\\right", ""), ("\\displaystyle", ""), ("\\$", "$"),
                     ("\\%", "%"), ("^\\circ", ""), ("^{\\circ}", ""), ("°", ""), ("\\(", ""), ("\\)", ""),
                     ("\\[", ""), ("\\]", ""), ("**", ""), ("−", "-"), ("\\cdot", "*"), ("\\times", "*")):
        s = s.replace(old, new)
    s = s.strip().strip("$").strip()
    if s.count("$") == 2 and s.startswith("$"):
        s = s.replace("$", "")  # '$5$ dollars'
    s = _LATEX_FRAC.sub(lambda m: " {}/{}".format(*(_atom(m.group(i) or m.group(i + 1)) for i in (1, 3))), s)
    if "=" in s and not re.search(r"[<>]=|\\[lg]eq?", s):
        s = s.rsplit("=", 1)[1]  # '35+28+14 = 77', '9 \times 2 = 18', 'x = 5': the right-hand side
    return s.strip().rstrip(".").strip()


def _atom(x: str) -> str:
    """A \\frac part as written in a/b: bare if one token, else in parentheses."""
    x = x.strip()
    return x if re.fullmatch(r"-?(?:\w+|\\[a-zA-Z]+)", x) else f"({x})"


def to_number(text: str | None) -> Fraction | None:
    """The number that a whole answer's text is, exactly, or None if it is not one number ('4a-3', '(2, 3)').
    Currency, %, units after it, thousands separators, a/b, \\frac and mixed numbers are understood."""
    if text is None:
        return None
    s = clean(text)
    s = s[1:-1] if s[:1] == "(" and s[-1:] == ")" and "," not in s else s  # '(42)', not the pair '(2, 3)'
    m = _NUMBER_ANSWER.fullmatch(s)
    if m is None or sum(c.isdigit() for c in m.group(0)) > MAX_DIGITS:
        return None
    try:  # exact: '0.75' == '3/4', '18.0' == '18'
        value = Fraction(m["num"].replace(",", "")) / Fraction(m["den"].replace(",", "") if m["den"] else 1)
    except ZeroDivisionError:
        return None
    value += int(m["whole"] or 0)
    return -value if m["sign"] == "-" else value


def first_number(text: str) -> Fraction | None:
    """The first number in a text: how a phrase like 'the answer is 5 apples and 3 pears' is read."""
    m = _ANY_NUMBER.search(clean(text))
    return to_number(m.group(0)) if m else None


def normalise(text: str) -> str:
    """A non-numeric answer for string comparison: clean, no spaces, x^{2} as x^2, \\sqrt3 as \\sqrt{3}, a
    choice '(A)' as 'A'."""
    s = re.sub(r"\s+", "", clean(text))
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", re.sub(r"([_^])\{(\w)\}", r"\1\2", s))  # x^{2} = x^2, \sqrt3
    choice = _CHOICE.fullmatch(s)
    return choice.group(1).upper() if choice else s


def reference_answer(answer: str) -> str:
    """GSM8K's answer field ends in '#### N': the reference is N. Other answers pass through."""
    m = _HASHES.findall(answer)
    return m[-1].strip() if m else answer.strip()


# ------------------------------------------------------------------------------ rewards
def reads_answer(fn):
    """Marks a reward that grades the completion against the reference answer (records must hold one)."""
    fn.reads_answer = True
    return fn


def is_correct(completion: str, answer: str) -> bool:
    """The completion's final answer (final_answer) against the reference: as exact numbers when the
    reference is one number, else as normalised strings (a multiple-choice letter: the answer's leading
    letter). A boxed or tagged answer is taken whole; a phrase or '#### N' may have words around its
    number, and a phrase with no number ('the answer is not possible') is no answer: the last number is."""
    ref = to_number(answer)
    found, kind = final_answer(completion)
    if found is None:
        return False
    if ref is None:
        want, got = normalise(answer), normalise(found)
        if len(want) == 1 and want.isalpha():  # multiple choice: '(B) 12', 'B.', '\\text{(B)}'
            m = _CHOICE.match(re.sub(r"\s+", " ", clean(found)).strip())
            return bool(m) and m.group(1).upper() == want
        return bool(want) and got == want
    pred = to_number(found)
    if pred is None and kind in ("hashes", "phrase"):
        pred = first_number(found) if _ANY_NUMBER.search(found) else to_number(last_number(completion))
    return pred is not None and pred == ref


@reads_answer
def correct(completion: str, answer: str, **kw) -> float:
    """1 if the extracted final answer equals the reference numerically, else 0."""
    return 1.0 if is_correct(completion, answer) else 0.0


@reads_answer
def correct_pm1(completion: str, answer: str, **kw) -> float:
    """DAPO (2503.14476) §2.4 rule-based reward: +1 if correct, -1 otherwise."""
    return 1.0 if is_correct(completion, answer) else -1.0


def r1_format(completion: str, answer: str, **kw) -> float:
    """DeepSeek-R1 (2501.12948) format reward: '<think>...</think><answer>...</answer>' and nothing else, or
    the same with <reasoning>...</reasoning> (the regex ^<think>.*?</think>\\s*<answer>.*?</answer>$, as scans)."""
    s = completion.strip()
    for tag in ("think", "reasoning"):
        if s.startswith(f"<{tag}>") and s.endswith("</answer>") and re.search(rf"</{tag}>\s*<answer>", s):
            return 1.0
    return 0.0


@reads_answer
def math_verify(completion: str, answer: str, **kw) -> float:
    """Optional (pip install math-verify): Hugging Face's checker, the one TRL's accuracy reward uses, on
    the final answer found as above: both sides parsed to sympy and compared (equivalent expressions,
    sets, intervals). Slower; its timeouts use SIGALRM, so call it from the main thread (grpo.py does)."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ImportError("--rewards math_verify needs `pip install math-verify`") from None
    found, _ = final_answer(completion)
    if found is None or len(found) > MAX_ANSWER:
        return 0.0
    return 1.0 if verify(parse(f"${answer}$"), parse(f"${found}$")) else 0.0


@reads_answer
def cosine(completion: str, answer: str, length: int = 0, max_length: int = 256, **kw) -> float:
    """Demystifying Long CoT (2502.03373) App. C.1, with TRL's get_cosine_scaled_reward defaults: correctness
    scaled by the length (tokens) on a cosine, 1.0 at length 0 down to 0.5 at max_length when correct, -1.0 up
    to -0.5 when wrong: short right answers score best, short wrong ones worst. Past max_length the length
    counts as max_length. grpo.py passes max_length = --max-new-tokens (T; 256 is its default)."""
    progress = min(length / max_length, 1.0)
    lo, hi = (0.5, 1.0) if is_correct(completion, answer) else (-0.5, -1.0)  # at max_length, at 0
    return lo + 0.5 * (hi - lo) * (1 + math.cos(math.pi * progress))


def repetition(completion: str, answer: str, *, ngram_size: int = 3, max_penalty: float = -1.0,
               **kw) -> float:
    """Demystifying Long CoT (2502.03373) App. C.2, as open-r1: the share of repeated n-grams of the lower-cased
    whitespace words, (1 - unique / total) * max_penalty; 0 with fewer than n words. (TRL's
    get_repetition_penalty_reward counts n-grams of token ids; a reward gets the text.)"""
    words = completion.lower().split()
    grams = list(zip(*[words[i:] for i in range(ngram_size)]))
    if not grams:
        return 0.0
    return (1 - len(set(grams)) / len(grams)) * max_penalty


REWARDS = {"correct": correct, "correct_pm1": correct_pm1, "format": r1_format, "math_verify": math_verify,
           "cosine": cosine, "repetition": repetition}


# ------------------------------------------------------------------------------ a reward model
def reward_model(path: str, render, batch: int = 8, device="cpu", bf16=False, four_bit=False):
    """A sequence classifier of one label as a reward, as TRL's reward_funcs=ID (_calculate_rewards): its
    logit for the chat, render(tok, record, reply=completion) (grpo.prompt_text: the prompt as the policy
    read it, then the completion as the assistant's turn) in the classifier's own chat template (without one:
    prompt + completion), right padded, `batch` rows a forward, read at the last token that is not padding. It
    lives on `device` for the run, in bf16 (else fp32; NF4 with four_bit, as the policy's weights), never
    trained. -> fn(completions, records): their scores, all of a step's completions in one call (fn.batched,
    for grpo.score). ValueError: a checkpoint that is not such a classifier, or a tokenizer with ids past its
    embedding (another model's)."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, BitsAndBytesConfig
    config = AutoConfig.from_pretrained(path)
    kinds = config.architectures or ["a config with no architecture"]
    if not any(kind.endswith("ForSequenceClassification") for kind in kinds):
        raise ValueError(f"{kinds[0]} is not a sequence classifier (its score head would be random)")
    if config.num_labels != 1:
        raise ValueError(f"a classifier of {config.num_labels} labels: a reward model has one, the score")
    tok = AutoTokenizer.from_pretrained(path)
    vocab = config.get_text_config().vocab_size
    if len(tok) > vocab:
        raise ValueError(f"its tokenizer has {len(tok)} tokens, its embedding {vocab}: another model's")
    tok.pad_token = tok.pad_token or tok.eos_token  # as TRL; the score is read at the last token but padding
    dtype = torch.bfloat16 if bf16 else torch.float32
    kw = dict(dtype=dtype, device_map={"": device})
    if four_bit:
        kw["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                       bnb_4bit_use_double_quant=True,
                                                       bnb_4bit_compute_dtype=dtype)
    model = AutoModelForSequenceClassification.from_pretrained(path, **kw).eval().requires_grad_(False)
    model.config.pad_token_id = tok.pad_token_id

    @torch.no_grad()
    def score(completions: list[str], records: list[dict], **_) -> list[float]:  # (_: a record's fields)
        texts = [render(tok, r, reply=c) for r, c in zip(records, completions)]
        out = []
        for i in range(0, len(texts), batch):
            enc = tok(texts[i:i + batch], return_tensors="pt", padding=True, padding_side="right",
                      add_special_tokens=False).to(model.device)
            out += model(**enc, use_cache=False).logits[:, 0].float().tolist()
        return out
    score.batched = True
    return score


# ------------------------------------------------------------------------------ the built-in tool
CALCULATOR_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
                  ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def calculator(expression: str) -> str:
    """Evaluates arithmetic: numbers, + - * / // % ** and parentheses, e.g. "(12 + 3) * -4 / 5".

    Args:
        expression: the arithmetic expression
    """
    if len(expression) > 1000:
        raise ValueError("the expression is longer than 1000 characters")
    def value(node):  # walks the parse tree: no name, call or attribute is ever reached, nothing is eval'd
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            x = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            x = -value(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in CALCULATOR_OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 100:  # before it is computed: 9**9**9 never is
                raise ValueError("an exponent over 100")
            x = CALCULATOR_OPS[type(node.op)](left, right)
        else:
            raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")
        if isinstance(x, complex) or not abs(x) <= 1e100:  # (-8) ** 0.5; inf, nan; numbers of over 100 digits
            raise ValueError("the result is not a real number within ±1e100")
        return x
    return str(value(ast.parse(expression, mode="eval").body))


def overlong_penalty(buffer: int, /, completion: str, answer: str, *, length: int, max_length: int,
                     **kw) -> float:
    """DAPO (2503.14476) §3.4 soft overlong punishment, eq. 13, a reward (--overlong-penalty binds buffer, by
    place: no record field sets it), with L_max = max_length (T), L_cache = buffer: 0 up to L_max - L_cache
    tokens, then falling linearly to -1 at L_max."""
    if length <= max_length - buffer:
        return 0.0
    if length <= max_length:
        return ((max_length - buffer) - length) / buffer
    return -1.0
