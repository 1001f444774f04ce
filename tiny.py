"""A tiny Qwen2 model and byte-level tokenizer built locally (nothing is downloaded), up to Qwen2.5-0.5B's widths."""
import itertools

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen2.5-Instruct's rendering of tools (a `# Tools` system block of JSON schemas, its default system message
# when none is given), of an assistant's tool calls and of tool results (a user turn of <tool_response>s): the
# subset of its chat template that --tools meets, written anew and checked against the original's output
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
TOOLS_CHAT_TEMPLATE = (
    "{% set nl = '\\n' %}<|im_start|>system{{ nl }}"
    "{{ messages[0].content if messages[0].role == 'system' else '" + QWEN_SYSTEM + "' }}"
    "{% if tools %}{{ nl }}{{ nl }}# Tools{{ nl }}{{ nl }}You may call one or more functions to assist with the user "
    "query.{{ nl }}{{ nl }}You are provided with function signatures within <tools></tools> XML tags:{{ nl }}<tools>"
    "{% for tool in tools %}{{ nl }}{{ tool | tojson }}{% endfor %}{{ nl }}</tools>{{ nl }}{{ nl }}For each function "
    "call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:{{ nl }}"
    "<tool_call>{{ nl }}{\"name\": <function-name>, \"arguments\": <args-json-object>}{{ nl }}</tool_call>"
    "{% endif %}<|im_end|>{{ nl }}{% for m in messages %}"
    "{% if m.role == 'tool' %}{% if loop.first or loop.previtem.role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ nl }}<tool_response>{{ nl }}{{ m.content }}{{ nl }}</tool_response>"
    "{% if loop.last or loop.nextitem.role != 'tool' %}<|im_end|>{{ nl }}{% endif %}"
    "{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant"
    "{% if m.content %}{{ nl }}{{ m.content }}{% endif %}{% for call in m.tool_calls %}"
    "{% set call = call.function or call %}{{ nl }}<tool_call>{{ nl }}{\"name\": \"{{ call.name }}\", \"arguments\": "
    "{{ call.arguments | tojson }}{{ '}' }}{{ nl }}</tool_call>{% endfor %}<|im_end|>{{ nl }}"
    "{% elif not (loop.first and m.role == 'system') %}<|im_start|>{{ m.role }}{{ nl }}{{ m.content }}<|im_end|>"
    "{{ nl }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{{ nl }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>"]
# Qwen2's pre-tokenizer: words with their leading space, digits one by one, punctuation runs
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
               r"\s+(?!\S)|\s+")


def make_tokenizer(chat_template=CHAT_TEMPLATE, pad="<|endoftext|>", vocab_size=0, corpus=()):
    """Byte-level BPE with one token per byte and no merges: Qwen2's scheme, tiny. vocab_size pads the
    vocabulary with multi-byte tokens (pairs, then triples of byte symbols) that encoding never
    produces but every one of which decodes, as a real model's vocabulary does. corpus (texts): BPE merges
    learnt from it instead, up to vocab_size, with Qwen2's pre-tokenizer (so a number is one token a digit)."""
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(SPECIALS + byte_chars)}
    fillers = itertools.chain(itertools.product(byte_chars, repeat=2), itertools.product(byte_chars, repeat=3))
    for chars in itertools.islice(fillers, max(0, vocab_size - len(vocab))):  # (a corpus's training replaces them)
        vocab["".join(chars)] = len(vocab)
    tk = Tokenizer(models.BPE(vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if not corpus else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if corpus:
        tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                                           initial_alphabet=byte_chars, show_progress=False))
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token=pad, unk_token="<|unk|>",
                                   chat_template=chat_template)


QWEN25_05B = dict(vocab=151936, hidden=896, heads=14, kv_heads=2, intermediate=4864)  # 24 layers in the real one


def make_tiny(path, layers=2, hidden=64, seed=0, vocab=0, heads=4, kv_heads=2, intermediate=0, labels=0, **tok_kw):
    """A random Qwen2 and its tokenizer saved to path. tiny.make_tiny(path, layers=2, **tiny.QWEN25_05B)
    has Qwen2.5-0.5B's widths (vocabulary, hidden, heads, MLP) with fewer layers. labels > 0: a sequence
    classifier with that many (a reward model has one: --reward-model) instead of a causal LM."""
    torch.manual_seed(seed)
    tok = make_tokenizer(vocab_size=vocab, **tok_kw)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, num_labels=labels or 2)
    model = Qwen2ForSequenceClassification(cfg) if labels else Qwen2ForCausalLM(cfg)
    if not labels:
        model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def fixed_groups(tok, rewards, a, seed=0, teacher_per_group=0):
    """Rows as grpo.rollout() makes them, with seeded random completions instead of samples: rewards (B, G)
    given (grpo.train_step makes the advantages). Last teacher_per_group rows of each group are marked teacher."""
    import random
    import grpo
    rng = random.Random(seed)
    rows = []
    for b, rs in enumerate(torch.as_tensor(rewards, dtype=torch.float32)):
        record = {"prompt": f"What is {b} + {b * 7 % 10}?" + " pad" * (b % 3), "answer": "0"}
        text = grpo.chat_prompt(tok, record["prompt"], a.system_prompt)
        prompt_ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
        for i, r in enumerate(rs.tolist()):
            n = rng.randint(1, a.max_new_tokens)
            ids = [rng.randrange(4, len(tok)) for _ in range(n)] + [tok.eos_token_id]
            comp = torch.tensor(ids[:a.max_new_tokens])
            rows.append(dict(record=record, order=b, prompt_ids=prompt_ids, completion=comp, text="",
                             truncated=len(ids) > a.max_new_tokens, reward=r, rewards={}, tool_calls=[],
                             logp=torch.full((len(comp),), float("nan")), tool_mask=torch.ones(len(comp)),
                             is_teacher=i >= len(rs) - teacher_per_group))
    return rows


CONFIGS = [("token-mean", False), ("seq-mean-token-sum-norm", False), ("seq-mean-token-mean", True)]


def ddp_updates(model_dir, out):
    """For each (loss_agg, split) in CONFIGS: one train_step with SGD(lr=1) on fixed completions, whole
    groups split over the ranks (or all in one process); rank 0 saves the parameter changes (minus
    the step's gradient) and the step's metrics."""
    import grpo
    rank, world, device = grpo.setup_distributed()
    results = {}
    for loss_agg, split in CONFIGS:
        pool = out + ".pool.jsonl"  # (a pool the flags name; the groups are made here)
        open(pool, "a").close()
        extra = ["--teacher-pool", pool, "--teacher-per-group", "2", "--split-grads"] if split else []
        extra += ["--num-generations", "2" if split else "4"]  # G = 4 rows a group, as the rewards below
        a = grpo.parse_args(["--model", model_dir, "--loss-agg", loss_agg, "--max-new-tokens", "8", "--max-grad-norm",
                             "0", "--micro-batch-size", "3", "--beta", "0", "--scale", "std"] + extra)
        torch.manual_seed(0)
        model, tok, _ = grpo.load_model(a, device)
        rewards = [[1, 0, 0, 1], [0, 0, 0, 0], [0, 0.5, 1, 1], [2, 1, 0, 1], [1, 1, 1, 1], [0, 3, 0, 0]]
        rows = fixed_groups(tok, rewards, a, seed=1, teacher_per_group=2 if split else 0)
        groups = [r for r in rows if r["order"] % world == rank]  # whole groups a rank
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        before = {n: p.detach().clone() for n, p in params.items()}
        m = grpo.train_step(model, None, torch.optim.SGD(params.values(), lr=1.0), groups, a)
        results[(loss_agg, split)] = {"update": {n: p.detach() - before[n] for n, p in params.items()}, "metrics": m}
    if rank == 0:
        torch.save(results, out)
    if world > 1:  # together: a rank that tears the group down while the other still reads it aborts it
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    import sys
    if len(sys.argv) == 2 and not sys.argv[1].startswith("-"):  # python tiny.py DIR: a model to try grpo.py on
        print(f"a tiny random Qwen2 and its tokenizer in {make_tiny(sys.argv[1], chat_template=TOOLS_CHAT_TEMPLATE)}")
    elif len(sys.argv) == 3:  # the two-process test: python tiny.py MODEL_DIR OUT.pt, or under torchrun
        ddp_updates(sys.argv[1], sys.argv[2])
    else:
        sys.exit("usage: python tiny.py DIR    (builds a tiny random Qwen2 and its tokenizer in DIR)")
