"""Training data without a server: held-out prompts kept out, and the dataset's own replies
as responses (resumable, sharing one file with regenerated samples)."""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dflash_sglang.datasets import MATH_INSTRUCTION
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


def test_file_prompts_dedupe_decontaminate_and_name_bad_lines(tmp_path):
    heldout = data.heldout_sets()["mt_bench"][0]
    rows = [
        {"text": "Tom has 3 apples. How many are left?", "source": "gsm_symbolic"},
        {"text": "tom has 3 APPLES, how many are left"},  # the same words: a repeat
        {"text": heldout},  # a held-out prompt never becomes training data
        {"text": "A second problem."},
    ]
    path = tmp_path / "prompts_x.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n\n")
    prompts = data.file_prompts(path, limit=10)
    assert [(p.source, p.text) for p in prompts] == [
        ("gsm_symbolic", rows[0]["text"]),
        ("prompts_x", "A second problem."),
    ]
    assert prompts[0].id == data.prompt_id("gsm_symbolic", rows[0]["text"])
    assert data.file_prompts(path, limit=1) == prompts[:1]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="line 2"):
        data.file_prompts(bad, limit=10)
    bad.write_text(json.dumps({"text": 3}) + "\n")
    with pytest.raises(ValueError, match="line 1: text and source must be strings"):
        data.file_prompts(bad, limit=10)


def _samples(prefix: str, n: int) -> list[dict]:
    return [{"id": f"{prefix}{i}", "prompt_ids": [1], "response_ids": [i]} for i in range(n)]


def test_mix_draws_like_random_sample_and_refuses_repeats():
    import random

    a, b, c = _samples("a", 5), _samples("b", 20), _samples("c", 30)
    rows = data.mix([(a, None), (b, 4), (c, 6)], seed=7)
    random.seed(7)  # the recipe's old inline scripts: sample in order, then shuffle
    expected = a + random.sample(b, 4) + random.sample(c, 6)
    random.shuffle(expected)
    assert rows == expected and len(rows) == 15
    assert data.mix([(a, None), (b, 4)], seed=7, shuffle=False)[:5] == a
    assert data.mix([(b, 4)], seed=8) != data.mix([(b, 4)], seed=7)
    with pytest.raises(ValueError, match="id a1 twice"):
        data.mix([(a, None), (a[1:2], None)], seed=0)
    with pytest.raises(ValueError, match="6 samples asked of a group of 5"):
        data.mix([(a, 6)], seed=0)
    assert a == _samples("a", 5)  # the caller's lists are not touched


def test_mix_from_the_cli_rebuilds_the_same_bytes(tmp_path, capsys):
    from dflash_sglang.training.__main__ import main

    files = []
    for name, n in (("x.jsonl.gz", 6), ("y.jsonl", 8), ("z.jsonl", 9)):
        path = tmp_path / name
        text = "".join(json.dumps(r) + "\n" for r in _samples(name[0], n))
        path.write_bytes(gzip.compress(text.encode()) if name.endswith(".gz") else text.encode())
        files.append(str(path))
    args = [files[0], f"{files[1]},{files[2]}:10", "--seed", "3"]
    assert main(["mix", *args, "--out", str(tmp_path / "m1.jsonl")]) == 0
    assert main(["mix", *args, "--out", str(tmp_path / "m2.jsonl")]) == 0
    m1 = (tmp_path / "m1.jsonl").read_bytes()
    assert m1 == (tmp_path / "m2.jsonl").read_bytes()
    rows = data.read_samples(tmp_path / "m1.jsonl")
    assert len(rows) == 16 and sum(r["id"].startswith("x") for r in rows) == 6
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"text": "a prompt"}) + "\n")
    (tmp_path / "torn.jsonl").write_text('{"id": "t0", "prompt_ids": [1]}\n{"id": "t1", "pro\n')
    for bad, message in (
        ([f"{files[0]}:0"], "N after ':' must be a positive integer"),
        ([f"{files[0]}:7"], "7 samples asked of a group of 6"),
        ([files[0], files[0]], "id x0 twice"),
        ([str(tmp_path / "none.jsonl")], "none.jsonl: no such file"),
        ([str(tmp_path / "prompts.jsonl")], "a sample without an id"),
        ([str(tmp_path / "torn.jsonl")], "torn.jsonl: line 2 is not JSON"),
    ):
        assert main(["mix", *bad, "--seed", "1", "--out", str(tmp_path / "bad.jsonl")]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "bad.jsonl").exists()  # nothing written on an error
    assert main(["mix", files[0], "--seed", "1", "--out", str(tmp_path / "no" / "m.jsonl")]) == 2
    assert "--out" in capsys.readouterr().err


def test_mix_exclude_leaves_out_rows_earlier_mixes_trained_on(tmp_path, capsys):
    from dflash_sglang.training.__main__ import main

    new, old = tmp_path / "new.jsonl", tmp_path / "old.jsonl"
    new.write_text("".join(json.dumps(r) + "\n" for r in _samples("n", 10)))
    assert main(["mix", f"{new}:4", "--seed", "1", "--out", str(old)]) == 0
    seen = {r["id"] for r in data.read_samples(old)}
    out = tmp_path / "next.jsonl"
    assert main(["mix", f"{new}:6", "--seed", "2", "--exclude", str(old), "--out", str(out)]) == 0
    rest = {r["id"] for r in data.read_samples(out)}
    assert len(rest) == 6 and not rest & seen  # exactly the six rows the first mix left
    for exclude, message in (
        (str(old), "7 samples asked of a group of 6"),
        (f"{old},{tmp_path / 'none.jsonl'}", "--exclude " + str(tmp_path / "none.jsonl")),
    ):
        bad = str(tmp_path / "bad.jsonl")
        assert main(["mix", f"{new}:7", "--seed", "1", "--exclude", exclude, "--out", bad]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "bad.jsonl").exists()


def test_decontamination_looks_past_the_shared_math_wrapper():
    problem = "Seven ducks swim in the pond and then two of them fly away. How many are left?"
    heldout = MATH_INSTRUCTION.format(problem=problem)
    # Ends like the held-out problem, so with the wrapper it shared a 13-word run.
    other = _prompt(MATH_INSTRUCTION.format(problem="Ann has 5 pens. How many are left?"))
    copied = _prompt(MATH_INSTRUCTION.format(problem="Now: " + problem))
    assert list(data.decontaminate([other, copied], [heldout])) == [other]


def test_committed_samples_are_distinct_and_their_file_prompts_clean():
    """The repo's regenerated samples are trained on together: one id twice would weigh a
    prompt double, and a math or code prompt outside its cleaned prompts file could be
    held-out."""
    root = Path(__file__).resolve().parents[1] / "bench" / "drafter"
    ids: list[str] = []
    ids_by_source: dict[str, set[str]] = defaultdict(set)
    for path in sorted(root.glob("data*.jsonl.gz")):
        for row in data.read_samples(path):
            ids.append(row["id"])
            ids_by_source[row["source"]].add(row["id"])
    assert len(ids) == len(set(ids)) > 92_000
    prompt_files = sorted(root.glob("prompts_*.jsonl.gz"))
    assert len(prompt_files) == 6
    for path in prompt_files:
        # a prompts file's samples carry the sources its rows name (its own name by default)
        prompts = data.file_prompts(path, limit=10**6)
        sampled = set().union(*(ids_by_source[s] for s in {p.source for p in prompts}))
        assert sampled and sampled <= {p.id for p in prompts}, path.name


def test_an_interrupted_regenerate_sends_no_queued_prompt(models, tmp_path):
    """Ctrl-C (here raised from the progress callback) stops at once: the prompts still
    queued are never sent, and what finished is on disk for the resume."""
    seen: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(1)
            time.sleep(0.05)  # a reply takes a while, as a real one does
            body = json.dumps({"output_ids": [5, 6], "meta_info": {}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def interrupt(samples: int, tokens: int) -> None:
        raise KeyboardInterrupt

    out = tmp_path / "gen.jsonl"
    prompts = [_prompt(f"prompt {i}") for i in range(200)]
    tok = AutoTokenizer.from_pretrained(models["target"])
    try:
        with pytest.raises(KeyboardInterrupt):
            data.regenerate(
                prompts,
                out,
                server_url=f"http://127.0.0.1:{server.server_port}",
                tokenizer=tok,
                max_new_tokens=2,
                max_prompt_tokens=64,
                batch_size=2,
                progress=interrupt,
            )
    finally:
        server.shutdown()
    assert len(seen) <= 4  # the two in flight (and at most two more), not 200
    assert len(data.done_ids(out)) == 1  # the sample that finished first was written


def test_committed_heldout_files_are_each_sets_first_prompts():
    """Drafters are compared on these files (README 47.): the 80-prompt file must extend the
    20-prompt one, prompt for prompt, and hold each held-out set's first prompts only."""
    root = Path(__file__).resolve().parents[1] / "bench" / "drafter"

    def ids_by_set(name: str) -> dict[str, list[str]]:
        out: dict[str, list[str]] = defaultdict(list)
        for row in data.read_samples(root / name):
            out[row["source"]].append(row["id"])
        return out

    small, large = ids_by_set("heldout_greedy.jsonl.gz"), ids_by_set("heldout_greedy_80.jsonl.gz")
    assert set(large) == set(small) == {"mt_bench", "humaneval", "math"}
    for name, ids in large.items():  # rows in the order replies finished
        assert sorted(ids) == sorted(p.id for p in data.heldout_prompts(name, 80)), name
        assert sorted(small[name]) == sorted(p.id for p in data.heldout_prompts(name, 20)), name
        assert small[name] == ids[:20], name  # grown from the 20-prompt file
