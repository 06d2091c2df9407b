"""End to end on real SGLang servers (CPU, tiny random models): DFLASH_X vs plain decoding.

In float32, greedy DFLASH_X output must equal the same server without speculation token
for token. One AR and one DFLASH_X server are shared by every test here.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from dflash_sglang.loadtest import server_metrics
from tests.prompts import LONG, SHARED_PREFIX, SHORT
from tests.server import Server, ar_and_dflash

pytestmark = pytest.mark.server
MAX_NEW = 24
# Small enough that the long prompts below evict each other's cached prefixes.
POOL_TOKENS = "2400"


def _common(models) -> list[str]:
    return ["--model-path", str(models["target"]), "--dtype", "float32"]


@pytest.fixture(scope="module")
def servers(models, tmp_path_factory):
    common = [*_common(models), "--max-total-tokens", POOL_TOKENS]
    with ar_and_dflash(common, models["draft"], tmp_path_factory.mktemp("logs")) as pair:
        yield pair


@pytest.fixture(scope="module")
def sglang_forward(models, tmp_path_factory):
    """Plain decoding through SGLang's own eager target forward (our compiled one off)."""
    log = tmp_path_factory.mktemp("logs") / "sglang_forward.log"
    server = Server(
        [*_common(models), "--speculative-algorithm", "NONE", "--dflash-cpu-compile", "off"], log
    )
    yield server
    server.stop()


def _ids(server: Server, text: str, max_new: int = MAX_NEW) -> list[int]:
    return server.generate(text, max_new_tokens=max_new, ignore_eos=True)["output_ids"]


def test_single_requests_are_lossless(servers):
    ar, dx = servers
    for text in SHORT:
        assert _ids(dx, text) == _ids(ar, text), text


def test_concurrent_requests_are_lossless(servers):
    ar, dx = servers
    texts = [SHARED_PREFIX + " " + t for t in SHORT[:8]]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda t: _ids(dx, t), texts))
    assert got == [_ids(ar, t) for t in texts]


def test_radix_cache_hits_are_lossless(servers):
    ar, dx = servers
    first = dx.generate(SHARED_PREFIX, max_new_tokens=MAX_NEW, ignore_eos=True)
    again = dx.generate(SHARED_PREFIX, max_new_tokens=MAX_NEW, ignore_eos=True)
    assert again["meta_info"]["cached_tokens"] > 0
    assert first["output_ids"] == again["output_ids"] == _ids(ar, SHARED_PREFIX)


def test_long_prompt_and_eviction_are_lossless(servers):
    ar, dx = servers
    other = LONG.replace("brown", "lazy")
    expected = {t: _ids(ar, t) for t in (LONG, other)}
    for text in (LONG, other, LONG):  # each long prompt evicts the other's cached tokens
        out = dx.generate(text, max_new_tokens=MAX_NEW, ignore_eos=True)
        meta = out["meta_info"]
        assert meta["prompt_tokens"] > 1000
        assert out["output_ids"] == expected[text]
    assert meta["cached_tokens"] < meta["prompt_tokens"] // 2, "LONG was not evicted"


def test_acceptance_fields_and_metrics(servers):
    _, dx = servers
    meta = dx.generate(SHORT[0], max_new_tokens=MAX_NEW, ignore_eos=True)["meta_info"]
    assert meta["spec_verify_ct"] >= 1
    assert 1.0 <= meta["spec_accept_length"] <= 4.0
    assert sum(meta["spec_correct_drafts_histogram"]) == meta["spec_verify_ct"]
    metrics = requests.get(dx.url + "/metrics", timeout=30).text
    assert "sglang:spec_verify_calls_total" in metrics
    assert "sglang:spec_accept_length" in metrics


def test_sampling_returns_valid_text(servers):
    _, dx = servers
    for params in (
        {"temperature": 0.8, "top_p": 0.9},
        {"temperature": 1.0, "top_k": 20},
        {"temperature": 0.7, "top_p": 0.95, "top_k": 50, "min_p": 0.05},
    ):
        out = dx.generate(SHORT[1], max_new_tokens=MAX_NEW, ignore_eos=True, **params)
        assert len(out["output_ids"]) == MAX_NEW
        assert isinstance(out["text"], str) and out["text"]
        assert all(0 <= t < 512 for t in out["output_ids"])


def test_openai_chat_completions(servers):
    _, dx = servers
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": SHORT[2]}],
        "max_tokens": 16,
        "temperature": 0,
    }
    r = requests.post(dx.url + "/v1/chat/completions", json=body, timeout=300)
    r.raise_for_status()
    reply = r.json()["choices"][0]["message"]["content"]
    with requests.post(
        dx.url + "/v1/chat/completions", json=body | {"stream": True}, stream=True, timeout=300
    ) as s:
        s.raise_for_status()
        chunks = [line for line in s.iter_lines() if line.startswith(b"data: ")]
    assert chunks[-1] == b"data: [DONE]"
    import json

    streamed = "".join(
        (json.loads(c[6:])["choices"][0]["delta"].get("content") or "")
        for c in chunks[:-1]
        if json.loads(c[6:])["choices"]
    )
    assert streamed == reply


def test_aborts_and_bad_requests_leave_the_server_consistent(servers):
    ar, dx = servers
    body = {
        "text": SHORT[3],
        "stream": True,
        "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True},
    }
    for _ in range(3):  # the client goes away mid-generation: SGLang aborts the request
        with requests.post(dx.url + "/generate", json=body, stream=True, timeout=300) as r:
            for i, _line in enumerate(r.iter_lines()):
                if i >= 3:
                    break
    too_long = requests.post(
        dx.url + "/generate",
        json={"text": LONG * 3, "sampling_params": {"max_new_tokens": 4}},
        timeout=300,
    )
    assert 400 <= too_long.status_code < 500 and too_long.text
    bad_params = requests.post(
        dx.url + "/generate",
        json={"text": "x", "sampling_params": {"temperature": -1}},
        timeout=300,
    )
    assert 400 <= bad_params.status_code < 500
    for text in SHORT[:4]:
        assert _ids(dx, text) == _ids(ar, text)


def test_constrained_decoding_and_logprobs_match_plain_decoding(servers):
    ar, dx = servers
    regex = {"regex": "(fox|dog|blocks)( (fox|dog|blocks)){5}"}
    outs = [s.generate(SHORT[5], max_new_tokens=MAX_NEW, **regex) for s in (ar, dx)]
    assert outs[0]["output_ids"] == outs[1]["output_ids"]
    assert len(outs[1]["text"].split()) == 6
    req = {"return_logprob": True}
    a, d = (s.generate(SHORT[6], max_new_tokens=8, ignore_eos=True, request=req) for s in (ar, dx))
    assert a["output_ids"] == d["output_ids"]
    a_lp = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
    d_lp = [x[0] for x in d["meta_info"]["output_token_logprobs"]]
    assert len(d_lp) == 8
    assert max(abs(x - y) for x, y in zip(a_lp, d_lp, strict=True)) < 1e-3


# --- Adaptive width and the suffix source, against the same AR server -------------------

# Texts that repeat themselves: suffix lookup finds matches in the prompt at once.
REPETITIVE = [" ".join([SHORT[i]] * 4) for i in range(4)]


# A request the `mixed` server has "served before it started": in its warm-start corpus.
WARM_PROMPT = [7, 301, 45, 118, 9, 260, 33, 402, 88, 150]


@pytest.fixture(scope="module")
def variants(models, servers, tmp_path_factory):
    """DFLASH_X pinned to plain decoding (width 1), and with suffix proposals (own text and
    finished requests' outputs) taken whenever one exists while the width changes every
    other step (exploration every 2 steps, whatever it costs: with an honest cost model the
    default 1% budget rarely lets this tiny random drafter run), its shared lookup warmed
    from a corpus holding the plain server's reply to `WARM_PROMPT`; and with every request
    that has a suffix proposal verifying it beside its DFlash block as a two-branch tree on
    drafting steps (`--dflash-tree always`)."""
    logs = tmp_path_factory.mktemp("variant_logs")
    reply = servers[0].generate(input_ids=WARM_PROMPT, max_new_tokens=MAX_NEW, ignore_eos=True)
    corpus = logs / "warm.jsonl"
    record = {"prompt_ids": WARM_PROMPT, "response_ids": reply["output_ids"]}
    corpus.write_text(json.dumps({"prompt": "unrelated", "response": "text"}) + "\n")
    corpus.write_text(corpus.read_text() + json.dumps(record) + "\n")
    common = ["--model-path", str(models["target"]), "--dtype", "float32"]
    common += ["--max-total-tokens", POOL_TOKENS, "--speculative-draft-model-path"]
    common += [str(models["draft"])]
    plain = Server([*common, "--dflash-widths", "1"], logs / "plain.log")
    try:
        mixed = Server(
            [*common, "--dflash-suffix", "always", "--dflash-widths", "1,2,3,4"]
            + ["--dflash-explore-every", "2", "--dflash-explore-budget", "1"]
            + ["--dflash-suffix-shared", "4096"]
            + ["--dflash-suffix-warm", str(corpus)],
            logs / "mixed.log",
        )
        tree = Server(
            [*common, "--dflash-tree", "always", "--dflash-widths", "1,4"]
            + ["--dflash-suffix-shared", "4096"],
            logs / "tree.log",
        )
    except Exception:
        plain.stop()
        if "mixed" in locals():
            mixed.stop()
        raise
    yield {"plain": plain, "mixed": mixed, "tree": tree}
    for server in (plain, mixed, tree):
        server.stop()


def test_width_one_throughout_is_lossless_and_never_drafts(servers, variants):
    ar, _ = servers
    plain = variants["plain"]
    before = server_metrics.scrape(plain.url)
    for text in SHORT[:6] + REPETITIVE[:2]:
        assert _ids(plain, text) == _ids(ar, text), text
    deltas = server_metrics.counter_deltas(before, server_metrics.scrape(plain.url))
    steps = server_metrics.total(deltas, "dflash_num_steps_total")
    assert steps > 0
    assert server_metrics.total(deltas, "dflash_num_plain_steps_total") == steps
    assert server_metrics.total(deltas, "dflash_num_drafts_total") == 0
    assert server_metrics.total(deltas, "dflash_draft_seconds_count") == 0


def test_suffix_proposals_and_changing_widths_are_lossless(servers, variants):
    ar, _ = servers
    mixed = variants["mixed"]
    before = server_metrics.scrape(mixed.url)
    for text in SHORT[:6] + REPETITIVE:
        assert _ids(mixed, text) == _ids(ar, text), text
    texts = REPETITIVE + SHORT[6:10]  # concurrent: some rows suffix, some DFlash
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda t: _ids(mixed, t), texts))
    assert got == [_ids(ar, t) for t in texts]
    first = mixed.generate(REPETITIVE[0], max_new_tokens=MAX_NEW, ignore_eos=True)
    assert first["meta_info"]["cached_tokens"] > 0  # a radix hit, same output
    assert first["output_ids"] == _ids(ar, REPETITIVE[0])

    deltas = server_metrics.counter_deltas(before, server_metrics.scrape(mixed.url))
    for source in ("dflash", "suffix"):
        key = server_metrics.sample_key("dflash_num_drafts_total", {"source": source})
        assert deltas.get(key, 0) > 0, f"no {source} proposal was verified"
    buckets = [
        server_metrics.total(deltas, f'dflash_step_verify_width_bucket{{le="{w:.1f}"}}')
        for w in (1, 2, 3, 4)
    ]
    steps_at = [b - a for a, b in zip([0.0, *buckets[:-1]], buckets, strict=True)]
    assert sum(1 for n in steps_at if n > 0) >= 3, f"steps per width 1..4: {steps_at}"


def test_shared_lookup_proposes_finished_outputs_losslessly(servers, variants):
    ar, _ = servers
    mixed = variants["mixed"]
    text = SHORT[12]
    expected = _ids(ar, text)
    before = server_metrics.scrape(mixed.url)
    for _ in range(3):  # from the second on, the first output is in the shared index
        assert _ids(mixed, text) == expected
    deltas = server_metrics.counter_deltas(before, server_metrics.scrape(mixed.url))
    shared = {"source": "shared"}
    assert deltas.get(server_metrics.sample_key("dflash_num_drafts_total", shared), 0) > 0
    assert deltas.get(server_metrics.sample_key("dflash_num_accepted_tokens_total", shared), 0) > 0
    stats = requests.get(f"{mixed.url}/dflash/stats", timeout=10).json()
    assert stats["since_start"]["tau_by_source"]["shared"] > 1.0


def test_a_warm_shared_lookup_proposes_from_its_corpus_at_once(servers, variants):
    """The first request of a prompt in the corpus is proposed its recorded reply."""
    ar, _ = servers
    mixed = variants["mixed"]
    before = server_metrics.scrape(mixed.url)
    out = mixed.generate(input_ids=WARM_PROMPT, max_new_tokens=MAX_NEW, ignore_eos=True)
    expected = ar.generate(input_ids=WARM_PROMPT, max_new_tokens=MAX_NEW, ignore_eos=True)
    assert out["output_ids"] == expected["output_ids"]
    deltas = server_metrics.counter_deltas(before, server_metrics.scrape(mixed.url))
    shared = {"source": "shared"}
    accepted = deltas.get(server_metrics.sample_key("dflash_num_accepted_tokens_total", shared), 0)
    assert accepted >= MAX_NEW // 2, f"{accepted} of {MAX_NEW} tokens from the corpus"
    held = server_metrics.scrape(mixed.url).gauges["dflash_suffix_shared_tokens"]
    assert len(WARM_PROMPT) + MAX_NEW <= held <= 4096  # at least the corpus's record + this
    assert "shared suffix lookup warmed from" in mixed.log_path.read_text()


@pytest.mark.parametrize("variant, text", [("mixed", REPETITIVE[1]), ("tree", REPETITIVE[3])])
def test_suffix_proposals_and_trees_keep_sampling_valid(variants, variant, text):
    server = variants[variant]
    for params in ({"temperature": 0.8, "top_p": 0.9}, {"temperature": 1.0, "min_p": 0.05}):
        out = server.generate(text, max_new_tokens=MAX_NEW, ignore_eos=True, **params)
        assert len(out["output_ids"]) == MAX_NEW
        assert all(0 <= t < 512 for t in out["output_ids"])


def test_two_branch_trees_are_lossless(servers, variants):
    """Trees (suffix and DFlash branches; a branch hanging off a shared prefix or the
    anchor) beside plain chains in one batch, radix hits and logprobs: the same tokens as
    plain decoding, and the tree's KV slots reordered so later steps read the right KV."""
    ar, _ = servers
    tree = variants["tree"]
    before = server_metrics.scrape(tree.url)
    for text in REPETITIVE[:2] + SHORT[:2]:
        assert _ids(tree, text) == _ids(ar, text), text
    texts = REPETITIVE + SHORT[6:10]  # concurrent: trees and DFlash chains in one batch
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda t: _ids(tree, t), texts))
    assert got == [_ids(ar, t) for t in texts]
    again = tree.generate(REPETITIVE[0], max_new_tokens=MAX_NEW, ignore_eos=True)
    assert again["meta_info"]["cached_tokens"] > 0
    assert again["output_ids"] == _ids(ar, REPETITIVE[0])
    req = {"return_logprob": True}
    a, t = (
        s.generate(REPETITIVE[2], max_new_tokens=8, ignore_eos=True, request=req)
        for s in (ar, tree)
    )
    assert a["output_ids"] == t["output_ids"]
    a_lp = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
    t_lp = [x[0] for x in t["meta_info"]["output_token_logprobs"]]
    assert max(abs(x - y) for x, y in zip(a_lp, t_lp, strict=True)) < 1e-3

    deltas = server_metrics.counter_deltas(before, server_metrics.scrape(tree.url))
    key = server_metrics.sample_key("dflash_num_drafts_total", {"source": "tree"})
    assert deltas.get(key, 0) > 0, "no tree was verified"
    stats = requests.get(f"{tree.url}/dflash/stats", timeout=10).json()
    assert stats["since_start"]["tau_by_source"]["tree"] > 1.0


COMPILED = "Target forward: compiled"


def test_the_compiled_target_forward_computes_what_sglangs_does(servers, sglang_forward):
    """On CPU the target's decode, verify and prefill run our compiled decoder stack by default
    (both servers above); in float32 it gives SGLang's own forward's tokens, alone and
    batched."""
    ar, dx = servers
    assert COMPILED in ar.log_path.read_text() and COMPILED in dx.log_path.read_text()
    assert "weights prepacked" in ar.log_path.read_text()  # --dflash-cpu-freeze on
    assert "Draft block forward: compiled" in dx.log_path.read_text()
    assert COMPILED not in sglang_forward.log_path.read_text()
    texts = [SHARED_PREFIX + " " + t for t in SHORT[:6]]
    with ThreadPoolExecutor(6) as pool:
        batched = list(pool.map(lambda t: _ids(sglang_forward, t), texts))
    assert batched == [_ids(ar, t) for t in texts]
    assert _ids(sglang_forward, LONG) == _ids(ar, LONG)


def _update_weights(server: Server, model_path: str) -> requests.Response:
    url = f"{server.url}/update_weights_from_disk"
    return requests.post(url, json={"model_path": model_path}, timeout=120)


def test_weight_updates_are_refused_while_the_compiled_forward_holds_packed_weights(
    servers, sglang_forward, models
):
    """With the weights prepacked (`--dflash-cpu-freeze on`, the default) an online update
    would not reach the compiled forward: it is refused with a reason before anything is
    written, and the server serves on unchanged. SGLang's own forward takes the update."""
    ar, dx = servers
    before = _ids(dx, SHORT[0])
    for server in (ar, dx):
        refused = _update_weights(server, str(models["target"]))
        assert refused.status_code == 400, refused.text
        assert "--dflash-cpu-freeze off" in refused.json()["message"]
    assert _ids(dx, SHORT[0]) == before == _ids(ar, SHORT[0])
    taken = _update_weights(sglang_forward, str(models["target"]))
    assert taken.status_code == 200 and taken.json()["success"], taken.text
    assert _ids(sglang_forward, SHORT[0]) == before
