"""The toy target: a synthetic chat corpus, a BPE tokenizer with a ChatML template, a tiny Qwen3.

Everything the embedded default needs to run the whole workflow on a 2-core CPU. Answers are
deterministic functions of the questions, so a tiny model learns them in a minute and a drafter can
predict them: acceptance lengths on the toy are meaningful, not noise.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from .config import ToyConfig
from .io import atomic_path, progress, write_parquet

TOY_MAX_POSITIONS = 4096  # the toy target's max_position_embeddings
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML as Qwen renders it; `enable_thinking` is accepted and ignored (the toy has no thinking mode).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2's pre-tokenizer split: digits are single tokens, so counting and sums are learnable.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

COLORS = {
    "banana": "yellow",
    "apple": "red",
    "lime": "green",
    "plum": "purple",
    "orange": "orange",
    "cherry": "red",
    "kiwi": "green",
    "lemon": "yellow",
    "blueberry": "blue",
    "coconut": "brown",
}
SOUNDS = {"cow": "moo", "dog": "woof", "cat": "meow", "duck": "quack", "sheep": "baa", "owl": "hoot"}
CAPITALS = {
    "France": "Paris",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Japan": "Tokyo",
    "Egypt": "Cairo",
    "Peru": "Lima",
    "Norway": "Oslo",
    "Kenya": "Nairobi",
    "Canada": "Ottawa",
    "Chile": "Santiago",
}
WORDS = {"add": ("adds", "+"), "sub": ("subtracts", "-"), "mul": ("multiplies by", "*")}


# Each task asks its question in a few phrasings (more distinct prompts) and answers in one fixed form.


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    op = rng.choice("+-")
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    ask = rng.choice(["What is {}?", "Compute {}.", "How much is {}?"])
    return ask.format(f"{a} {op} {b}"), f"{a} {op} {b} = {a + b if op == '+' else a - b}."


def _counting(rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.5:  # single digits: where to stop is a one-token match a tiny model learns fast
        start = rng.randint(0, 7)
        stop = rng.randint(start + 2, 9)
        ask = rng.choice(["List the numbers from {} to {}.", "Count from {} to {}."])
        return ask.format(start, stop), ", ".join(map(str, range(start, stop + 1))) + "."
    start = rng.randint(2, 12)  # answers stay under 48 tokens
    ask = rng.choice(["Count down from {}.", "Count backwards from {} to 0."])
    return ask.format(start), ", ".join(map(str, range(start, -1, -1))) + "."


def _facts(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(3)
    if kind == 0:
        fruit = rng.choice(sorted(COLORS))
        ask = rng.choice(["What color is a {}?", "What is the color of a {}?", "Tell me the color of a {}."])
        return ask.format(fruit), f"A {fruit} is {COLORS[fruit]}."
    if kind == 1:
        animal = rng.choice(sorted(SOUNDS))
        ask = rng.choice(["What sound does a {} make?", "What does a {} say?", "How does a {} sound?"])
        return ask.format(animal), f"A {animal} says {SOUNDS[animal]}."
    country = rng.choice(sorted(CAPITALS))
    ask = rng.choice(
        ["What is the capital of {}?", "Name the capital of {}.", "Which city is capital of {}?"]
    )
    return ask.format(country), f"The capital of {country} is {CAPITALS[country]}."


def _code(rng: random.Random) -> tuple[str, str]:
    name = rng.choice(sorted(WORDS))
    verb, op = WORDS[name]
    k = rng.randint(1, 9)
    ask = rng.choice(["Write a function {0}_{1} that {2} {1}.", "Define {0}_{1}, a function that {2} {1}."])
    return ask.format(name, k, verb), f"def {name}_{k}(x):\n    return x {op} {k}"


TASKS = [_arithmetic, _counting, _facts, _code]


def task_conversations(n: int, seed: int) -> list[list[dict]]:
    """`n` single-turn conversations drawn from the task generators (deterministic in `seed`)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        question, answer = rng.choice(TASKS)(rng)
        out.append([{"role": "user", "content": question}, {"role": "assistant", "content": answer}])
    return out


def _render(messages: list[dict]) -> str:
    # the same text CHAT_TEMPLATE produces; used before a tokenizer exists
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def build_tokenizer(conversations: list[list[dict]], vocab_size: int):
    """Byte-level BPE trained on the rendered conversations, with ChatML special tokens and template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)  # exact offsets for the loss mask
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((_render(c) for c in conversations), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=4096,
        padding_side="left",  # generation pads on the left
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_target(tokenizer, cfg: ToyConfig):
    """A randomly initialized Qwen3 whose embedding has free rows above len(tokenizer) (one is MASK)."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    vocab = (len(tokenizer) // 64 + 1) * 64  # rounded up to 64, always > len(tokenizer)
    eos, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=TOY_MAX_POSITIONS,
        tie_word_embeddings=False,
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    torch.manual_seed(cfg.seed)
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=pad, eos_token_id=[eos, pad], pad_token_id=pad, do_sample=False
    )
    return model


def _token_stream(tokenizer, conversations: list[list[dict]]) -> tuple[list[int], list[int]]:
    """Packed ids and labels: loss only on assistant turns (as in chat fine-tuning), -100 elsewhere."""
    from .chat import tokenize_conversation

    ids, labels = [], []
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    for c in conversations:
        doc, mask, _ = tokenize_conversation(tokenizer, c)
        ids += doc + [eot]
        labels += [t if m else -100 for t, m in zip(doc, mask, strict=True)] + [-100]
    return ids, labels


def train_target(model, tokenizer, conversations: list[list[dict]], cfg: ToyConfig) -> list[float]:
    """Next-token training on packed random windows of the corpus; returns the loss of every step."""
    import torch

    ids, labels = _token_stream(tokenizer, conversations)
    stream, targets = torch.tensor(ids), torch.tensor(labels)
    if len(stream) <= cfg.seq_len:
        raise ValueError(f"toy corpus has {len(stream)} tokens, fewer than seq_len {cfg.seq_len}")
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(  # short warmup, then linear decay to 10%
        opt, lambda s: min(1.0, (s + 1) / 20) * (1.0 - 0.9 * s / max(1, cfg.steps))
    )
    model.train()
    losses = []
    bar = progress(range(cfg.steps), desc="toy target", unit="step")
    for _ in bar:
        starts = torch.randint(0, len(stream) - cfg.seq_len, (cfg.batch_size,), generator=gen)
        batch = torch.stack([stream[s : s + cfg.seq_len] for s in starts.tolist()])
        label = torch.stack([targets[s : s + cfg.seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=label).loss  # HF shifts the labels itself
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    model.eval()
    return losses


def build_toy_target(cfg: ToyConfig, out_dir: str) -> None:
    """Corpus -> tokenizer -> tiny Qwen3 -> train -> HF model dir with tokenizer, written atomically.

    With cfg.steps=0 this takes a few seconds and yields a random (untrained) tiny target: tests use it
    whenever they need a real HF model directory but not a model that has learned anything."""
    conversations = task_conversations(cfg.num_docs, cfg.seed)
    tokenizer = build_tokenizer(conversations, cfg.vocab_size)
    model = make_target(tokenizer, cfg)
    if cfg.steps:
        losses = train_target(model, tokenizer, conversations, cfg)
        print(f"toy target: {cfg.steps} steps, loss {losses[0]:.3f} -> {sum(losses[-10:]) / 10:.3f}")
    with atomic_path(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)


def write_toy_sources(cfg: ToyConfig, out_dir: str) -> dict[str, str]:
    """Three prompt sources (ShareGPT jsonl, messages parquet, Alpaca json) of cfg.source_rows rows each.

    Drawn from the toy tasks with other seeds, with a few malformed rows (empty, non-string, unknown role,
    unparseable line, too long) and a few exact duplicates across sources, so cleaning has real work."""
    import pyarrow as pa

    out = Path(out_dir)
    n = cfg.source_rows
    if n < 12:
        raise ValueError(f"toy.source_rows must be >= 12 (malformed and duplicate rows need room), got {n}")
    bad_at = [n // 4, n // 2, 2 * n // 3]  # rows replaced by malformed ones, clear of the duplicates
    convs = [task_conversations(n, cfg.seed + 1000 + i) for i in range(3)]
    for i in range(3):  # exact duplicates: ShareGPT's first rows reappear in the other two
        convs[1][-1 - i] = convs[0][i]
        convs[2][-1 - i] = convs[0][i]
    too_long = "Repeat this. " * 3000  # ~39K chars: over the default prompts.max_chars
    paths = {}

    # ShareGPT jsonl, a few with a system turn
    role_from = {"user": "human", "assistant": "gpt", "system": "system"}
    lines = []
    for i, c in enumerate(convs[0]):
        turns = [{"from": role_from[m["role"]], "value": m["content"]} for m in c]
        if i % 10 == 5:
            turns.insert(0, {"from": "system", "value": "You are a helpful assistant."})
        lines.append(json.dumps({"id": f"sg-{i}", "conversations": turns}))
    bad = [
        '{"id": "sg-broken", "conversations": [{"from": "human", "value": "What is',  # unparseable
        json.dumps({"conversations": [{"from": "human", "value": "   "}, {"from": "gpt", "value": "x"}]}),
        json.dumps({"conversations": [{"from": "robot", "value": "beep"}, {"from": "gpt", "value": "boop"}]}),
    ]
    for j, line in zip(bad_at, bad, strict=True):
        lines[j] = line
    paths["sharegpt"] = str(out / "sharegpt.jsonl")
    with atomic_path(paths["sharegpt"]) as tmp:
        tmp.write_text("\n".join(lines) + "\n")

    # OpenAI-style messages parquet; content is a nullable string column, so non-string content is null
    rows = [[dict(m) for m in c] for c in convs[1]]
    rows[bad_at[0]] = [{"role": "user", "content": None}, {"role": "assistant", "content": "Nothing."}]
    rows[bad_at[1]] = [{"role": "user", "content": ""}, {"role": "assistant", "content": "Empty."}]
    rows[bad_at[2]] = [{"role": "user", "content": too_long}, {"role": "assistant", "content": "Done."}]
    msg_type = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    paths["messages"] = str(out / "messages.parquet")
    write_parquet(pa.table({"messages": pa.array(rows, type=msg_type)}), paths["messages"])

    # Alpaca json list; a few rows get an `input` field that the loader appends to the instruction
    records = [{"instruction": c[0]["content"], "input": "", "output": c[1]["content"]} for c in convs[2]]
    records[1] = {"instruction": "Say the number.", "input": "42", "output": "42."}
    records[bad_at[0]] = {"instruction": 12345, "input": "", "output": "A number is not an instruction."}
    records[bad_at[1]] = {"instruction": " \n ", "input": "", "output": "Blank."}
    paths["alpaca"] = str(out / "alpaca.json")
    with atomic_path(paths["alpaca"]) as tmp:
        tmp.write_text(json.dumps(records, indent=1))
    return paths
