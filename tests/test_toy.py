import json
import re

import pyarrow.parquet as pq
import pytest

from flashdraft import chat, toy
from flashdraft.config import DrafterConfig, ToyConfig
from flashdraft.target import load_target, mask_token_id

# the answer form of each task; a model that learned the corpus answers in these forms
FORMS = [
    r"\d [+-] \d = -?\d+\.",  # arithmetic
    r"\d+(, \d+)+\.",  # counting
    r"(A \w+ (is|says) \w+|The capital of \w+ is \w+)\.",  # facts
    r"def (add|sub|mul)_\d\(x\):\n    return x [+*-] \d",  # code
]


@pytest.fixture(scope="module")
def tokenizer():
    return toy.build_tokenizer(toy.task_conversations(400, 0), 512)


def test_tasks_are_deterministic_functions_of_the_question():
    convs = toy.task_conversations(2000, 1)
    assert convs == toy.task_conversations(2000, 1)
    assert convs != toy.task_conversations(2000, 2)
    answers = {}
    for user, assistant in convs:
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        assert answers.setdefault(user["content"], assistant["content"]) == assistant["content"]
    for form in FORMS:  # every task occurs, and every answer has its task's form
        assert any(re.fullmatch(form, a) for a in answers.values()), form
    assert all(any(re.fullmatch(f, a) for f in FORMS) for a in answers.values())
    assert len(answers) > 300  # distinct questions
    assert answers["What is 7 + 5?"] == "7 + 5 = 12."
    assert answers["List the numbers from 3 to 6."] == "3, 4, 5, 6."
    assert answers["Count down from 12."] == "12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0."
    assert answers["Write a function add_3 that adds 3."] == "def add_3(x):\n    return x + 3"


def test_tokenizer_template_and_special_tokens(tokenizer):
    msgs = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "2 + 2 = 4."}]
    full = tokenizer.apply_chat_template(msgs, tokenize=False)
    assert full == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n2 + 2 = 4.<|im_end|>\n"
    prompt = chat.render(tokenizer, msgs[:1], add_generation_prompt=True, thinking=True)
    assert prompt == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") in ids
    assert tokenizer.decode(ids) == full  # byte-level BPE round-trips exactly
    assert "4" in tokenizer.convert_ids_to_tokens(ids)  # digits are single tokens
    assert len(tokenizer) <= 512


def test_build_toy_target_untrained_is_a_loadable_hf_model(tmp_path):
    cfg = ToyConfig(steps=0, num_docs=300)
    out = tmp_path / "target"
    toy.build_toy_target(cfg, str(out))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    model, tok = load_target(str(out), "float32")
    assert type(model).__name__ == "Qwen3ForCausalLM"
    c = model.config
    assert c.vocab_size % 64 == 0 and c.vocab_size > len(tok)
    assert (c.hidden_size, c.num_hidden_layers, c.head_dim) == (cfg.hidden_size, cfg.num_layers, cfg.head_dim)
    assert not c.tie_word_embeddings and c.max_position_embeddings == 4096
    assert c.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.convert_tokens_to_ids("<|im_end|>") in model.generation_config.eos_token_id
    assert mask_token_id(tok, c, DrafterConfig()) == len(tok)
    assert tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    x = tok("<|im_start|>user\nWhat is 1 + 1?", return_tensors="pt", add_special_tokens=False)
    assert model(**x).logits.shape == (1, x.input_ids.shape[1], c.vocab_size)


def _greedy(model, tok, questions: list[str]) -> list[str]:
    texts = [chat.render(tok, [{"role": "user", "content": q}], True) for q in questions]
    x = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**x, max_new_tokens=96, do_sample=False, eos_token_id=tok.eos_token_id)
    return tok.batch_decode(out[:, x.input_ids.shape[1] :], skip_special_tokens=True)


def test_trained_toy_target_answers_in_distribution_prompts(one_thread):
    cfg = ToyConfig(steps=150, num_layers=4)  # a reduced run (the default trains 300 steps, 6 layers)
    convs = toy.task_conversations(cfg.num_docs, cfg.seed)
    tok = toy.build_tokenizer(convs, cfg.vocab_size)
    model = toy.make_target(tok, cfg)
    losses = toy.train_target(model, tok, convs, cfg)
    assert len(losses) == cfg.steps and sum(losses[-10:]) / 10 < 0.3 * losses[0]
    held_out = toy.task_conversations(120, 12345)
    answers = _greedy(model, tok, [c[0]["content"] for c in held_out])
    exact = [a == c[1]["content"] for a, c in zip(answers, held_out, strict=True)]
    formed = [any(re.fullmatch(f, a) for f in FORMS) for a in answers]
    assert sum(formed) >= 0.85 * len(answers), [a for a, f in zip(answers, formed, strict=True) if not f]
    assert sum(exact) >= 0.3 * len(answers), f"{sum(exact)}/{len(answers)} exact answers"
    code = [e for e, c in zip(exact, held_out, strict=True) if "function" in c[0]["content"]]
    assert sum(code) >= 0.8 * len(code)  # the most regular task is learned first


def test_write_toy_sources(tmp_path):
    cfg = ToyConfig(source_rows=40)
    paths = toy.write_toy_sources(cfg, str(tmp_path))
    assert set(paths) == {"sharegpt", "messages", "alpaca"}
    lines = open(paths["sharegpt"]).read().splitlines()
    assert len(lines) == 40
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    assert len(parsed) == 39  # one deliberately unparseable line
    assert {t["from"] for r in parsed for t in r["conversations"]} >= {"human", "gpt", "system", "robot"}
    msgs = pq.read_table(paths["messages"]).column("messages").to_pylist()
    assert len(msgs) == 40 and any(m[0]["content"] is None for m in msgs)
    assert max(len(m[0]["content"] or "") for m in msgs) > 32000
    alpaca = json.load(open(paths["alpaca"]))
    assert len(alpaca) == 40 and any(not isinstance(r["instruction"], str) for r in alpaca)
    # exact duplicates across sources: ShareGPT's first user turn reappears in both other sources
    first = parsed[0]["conversations"][0]["value"]
    assert first in [m[0]["content"] for m in msgs] and first in [r["instruction"] for r in alpaca]
    assert paths == toy.write_toy_sources(cfg, str(tmp_path))  # rewrite over existing files is fine
