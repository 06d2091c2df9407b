"""Training data without a server: held-out prompts kept out, and the dataset's own replies
as responses (resumable, sharing one file with regenerated samples)."""

from __future__ import annotations

import json

from transformers import AutoTokenizer

from dflash_sglang.training import data

HELD_OUT = "Write a persuasive email to convince your introverted friend to volunteer as a guest"


def _prompt(text: str, reference: str = "a reply") -> data.Prompt:
    return data.Prompt(data.prompt_id("t", text), "t", text, reference)


def test_decontaminate_drops_exact_and_13_word_overlaps():
    keep = _prompt("Tell me about foxes.")
    exact = _prompt(HELD_OUT.upper() + "!")
    overlap = _prompt("Please: " + HELD_OUT + " speaker at a local event.")
    assert list(data.decontaminate([keep, exact, overlap], [HELD_OUT])) == [keep]


def test_dataset_responses_are_the_replies_tokenized(models, tmp_path):
    tok = AutoTokenizer.from_pretrained(models["target"])
    out = tmp_path / "data.jsonl"
    regenerated = {"id": _prompt("first").id, "response_ids": [1, 2], "finish": "stop"}
    out.write_text(json.dumps(regenerated) + "\n")
    prompts = [_prompt("first"), _prompt("second", "the quick brown fox"), _prompt("x", " ")]
    assert data.dataset_responses(
        prompts, out, tokenizer=tok, max_new_tokens=3, max_prompt_tokens=64
    ) == 1  # fmt: skip
    rows = data.read_samples(out)
    assert rows[0] == regenerated  # kept, not overwritten
    (row,) = rows[1:]  # the empty reply is skipped
    assert row["id"] == prompts[1].id and row["finish"] == "dataset"
    assert row["response_ids"] == tok("the quick brown fox")["input_ids"][:3]
    assert row["prompt_ids"] == data.chat_ids(tok, "second", 64)
    assert (
        data.dataset_responses(prompts, out, tokenizer=tok, max_new_tokens=3, max_prompt_tokens=64)
        == 0
    )  # resumed: nothing left to add
