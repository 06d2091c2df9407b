"""bf16: where DFLASH_X and plain greedy decoding part ways, and why.

Verifying a block computes the same logits with differently shaped GEMMs than one-token
decoding, so bf16 rounding can flip a near-tie. Any divergence must be such a near-tie:
at the first differing position, both tokens are the target's top two and their logits
(as AR sees them) are close. A logic error would show as a clear-winner mismatch.
"""

from __future__ import annotations

import json

import pytest

from tests.prompts import SHORT, prompt
from tests.server import Server, ar_and_dflash

pytestmark = pytest.mark.server
MAX_NEW = 48
NEAR_TIE_NATS = 0.25  # far below the typical top-1/top-2 gap of this model


@pytest.fixture(scope="module")
def bf16_servers(models, tmp_path_factory):
    common = [
        "--model-path",
        str(models["target"]),
        "--dtype",
        "bfloat16",
        "--max-total-tokens",
        "4096",
    ]
    with ar_and_dflash(common, models["draft2"], tmp_path_factory.mktemp("logs_bf16")) as pair:
        yield pair


def _top2(ar: Server, input_ids: list[int]) -> list[tuple[float, int]]:
    out = ar.generate(
        input_ids=input_ids,
        max_new_tokens=1,
        request={"return_logprob": True, "top_logprobs_num": 2},
    )
    return [(lp, tok) for lp, tok, _ in out["meta_info"]["output_top_logprobs"][0]]


def test_bf16_divergence_is_rounding(models, bf16_servers, tmp_path_factory):
    from transformers import AutoTokenizer

    ar, dx = bf16_servers
    tokenizer = AutoTokenizer.from_pretrained(models["target"])
    texts = SHORT + [prompt(100 + i, 20) for i in range(8)]
    report = []
    for text in texts:
        ids = tokenizer(text).input_ids
        a_ids = ar.generate(input_ids=ids, max_new_tokens=MAX_NEW, ignore_eos=True)["output_ids"]
        d_ids = dx.generate(input_ids=ids, max_new_tokens=MAX_NEW, ignore_eos=True)["output_ids"]
        first = next((i for i, (x, y) in enumerate(zip(a_ids, d_ids, strict=True)) if x != y), None)
        entry = {"prompt": text[:40], "first_divergence": first}
        if first is not None:
            (lp1, t1), (lp2, t2) = _top2(ar, ids + a_ids[:first])
            entry |= {
                "ar_token": a_ids[first],
                "dflash_token": d_ids[first],
                "top2": [t1, t2],
                "gap_nats": lp1 - lp2,
            }
            assert {a_ids[first], d_ids[first]} <= {t1, t2}, entry
            assert lp1 - lp2 < NEAR_TIE_NATS, entry
        report.append(entry)
    diverged = [e for e in report if e["first_divergence"] is not None]
    summary = {
        "prompts": len(report),
        "diverged": len(diverged),
        "max_new_tokens": MAX_NEW,
        "cases": report,
    }
    out = tmp_path_factory.getbasetemp() / "bf16_divergence.json"
    out.write_text(json.dumps(summary, indent=1))
    print(f"\nbf16 divergence: {len(diverged)}/{len(report)} prompts differ; report: {out}")


def test_bf16_weights_are_prepacked(bf16_servers):
    """`--dflash-cpu-freeze on` (the default): in bf16 the compiled layers, the LM head and
    the drafter's feature projection all run on prepacked weights (the test above checks
    what they compute); on a CPU without oneDNN bf16 the weights are frozen, not packed."""
    from dflash_sglang.cpu_platform.compiled import bf16_packable

    ar, dx = bf16_servers
    packed = bf16_packable()
    target = "weights prepacked, LM head prepacked" if packed else "frozen, not prepacked"
    assert target in ar.log_path.read_text()
    draft_line = next(
        line for line in dx.log_path.read_text().splitlines() if "Draft block forward" in line
    )
    assert ("weights prepacked, fc prepacked" if packed else "frozen, not prepacked") in draft_line
