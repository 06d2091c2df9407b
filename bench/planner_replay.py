"""The planner at one request, replayed on the target's own greedy replies to held-out prompts:
no server, no timing noise, hundreds of replies in seconds.

    python bench/planner_replay.py tables --out bench/proposers/replay_tables_v47.json.gz  # ~10 min
    python bench/planner_replay.py run --tables bench/proposers/replay_tables_v47.json.gz \
        [--base REV] [--seeds 3] [--out bench/proposers/planner_replay.json]

`tables` runs the target (fp32) over every reply of `--data` (default: the committed 80
prompts per set, `bench/drafter/heldout_greedy_80.jsonl.gz`) and the drafter at every
response position: the DFlash block's acceptance length anchored at each token, as a server
step there would verify it (teacher-forced, the prompt's tokens added to the draft
vocabulary as `--dflash-prompt-vocab` does). The bundled drafter v47's tables are committed
(`bench/proposers/replay_tables_v47.json.gz`, 70 KB): a new drafter needs its own.

`run` decodes every reply again as DFLASH_X's default launch would at one request: per step
the request's own-text and shared suffix proposals (the shared index warm from the bundled
corpus, each finished reply joining it; sets in the order given, one planner throughout, as
`bench_proposers.py` serves them), the planner's plan, its verified source's accepted tokens
(from the table for the DFlash block, by lookup for a suffix proposal), and a step time from
`COST_MS` (the default launch's step times at one request, `bench/proposers/
v47_c1_4_16_256tok.json`) with Gaussian noise of `NOISE_MS`, seeded. With `--base REV` the
planner of git revision REV (`dflash_sglang/proposals.py` there) replays too, beside this
tree's: a before/after of a planner change without a server A/B, whose nine replies per set
swing with the path the planner takes (README). `--variants` replays planner variants kept
here, not served (`VARIANTS`), beside it.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import importlib.util
import json
import random
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from dflash_sglang import suffix_corpus
from dflash_sglang.adaptive import DEFAULT_CPU_PRIOR, CostModel
from dflash_sglang.metrics import tau
from dflash_sglang.options import SpecOptions
from dflash_sglang.proposals import Planner, StepPlan, candidates
from dflash_sglang.suffix import SharedSuffixIndex, SuffixIndex, SuffixProposal, accepted_len

HELDOUT = Path("bench/drafter/heldout_greedy_80.jsonl.gz")
SETS = ("mt_bench", "humaneval", "math")
BLOCK = 16
# One step at one request, ms: the rest of the step at width w, and the draft forward (the
# default launch with drafter v47: w1 14.1-15.7, w2 15.9, w4 16.1, w8 18.0, w16 21.3; the
# drafter +6.1 at w4). Plain decoding runs the width-1 step.
COST_MS = {"rest": 14.5, "per_width": 0.5, "draft": 6.0}
NOISE_MS = 0.5


def step_ms(width: int, run_draft: bool) -> tuple[float, float]:
    """(whole step, draft forward) in ms."""
    draft = COST_MS["draft"] if run_draft else 0.0
    return COST_MS["rest"] + COST_MS["per_width"] * (width - 1) + draft, draft


def tables(data: Path, sets: list[str], drafter_dir: Path, prompt_vocab: int) -> list[dict]:
    """Per reply: its set, prompt and response ids, and `dflash[i]`, the acceptance length
    (bonus included) of the step anchored at response token i."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_sglang.default_model import ensure_default_target
    from dflash_sglang.drafter import DFlashDrafter
    from dflash_sglang.training import evaluate
    from dflash_sglang.training.data import read_samples
    from dflash_sglang.training.features import OnlineExamples

    torch.set_num_threads(2)
    drafter = DFlashDrafter.load(drafter_dir).eval()
    target_dir = ensure_default_target(log=lambda m: print(m, file=sys.stderr))
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    samples = [s for s in read_samples(data) if s["source"] in sets and s["response_ids"]]
    layers = list(drafter.config.target_layer_ids)
    examples = OnlineExamples(target, samples, layers, max_len=2048)
    embed, weight = target.get_input_embeddings(), target.get_output_embeddings().weight
    out = []
    with torch.no_grad():
        for sample, ex in zip(samples, examples, strict=True):
            head = evaluate.prompt_head(drafter, weight, ex, prompt_vocab)
            out.append(
                {
                    "source": sample["source"],
                    "prompt_ids": sample["prompt_ids"],
                    "response_ids": sample["response_ids"][: len(ex.input_ids) - ex.prompt_len],
                    "dflash": evaluate.acceptance_everywhere(drafter, embed, head, ex),
                }
            )
            print(f"{len(out)}/{len(samples)} {sample['source']}", file=sys.stderr)
    return out


class Tally:
    """What one replay decoded, per source: drafts, accepted and predicted tokens."""

    def __init__(self) -> None:
        self.tokens = self.steps = 0
        self.ms = 0.0
        self.by_source: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])

    def add(self, source: str | None, accepted: int, expected: float, ms: float) -> None:
        self.tokens += accepted + 1
        self.steps += 1
        self.ms += ms
        if source is not None:
            row = self.by_source[source]
            row[0] += 1
            row[1] += accepted
            row[2] += expected

    def summary(self) -> dict:
        plain_ms = self.tokens * step_ms(1, False)[0]
        sources = {
            s: {"drafts": n, "tau": tau(acc, n), "predicted_tau": tau(exp, n)}
            for s, (n, acc, exp) in sorted(self.by_source.items())
        }
        return {
            "tokens": self.tokens,
            "x_plain": plain_ms / self.ms,
            "tau": self.tokens / self.steps,
            "sources": sources,
        }


def decode(planner, options: SpecOptions, shared, row: dict, tally: Tally, rng) -> None:
    """One reply, step by step: its first token comes from prefill, each step verifies the
    plan's source and commits its accepted tokens and the bonus."""
    out, dflash = row["response_ids"], row["dflash"]
    index = SuffixIndex(options.suffix_max_match, options.max_proposal(BLOCK))
    index.extend(row["prompt_ids"] + out[:1])
    done = 1

    def accept(proposal: SuffixProposal | None, offered: int) -> int:
        """Drafts a step from here accepts of `proposal` (None: the DFlash block)."""
        if proposal is None:
            n = dflash[done - 1] - 1
        else:
            n = accepted_len(proposal.tokens[:offered], out[done : done + offered])
        return min(n, offered, len(out) - done - 1)

    if isinstance(planner, Hindsight):
        planner.accept = accept
    while done < len(out):
        found = [index.propose(), shared.propose(index.tail(index.max_match))]
        plan = planner.plan([tuple(p for p in found if p is not None)])
        source = plan.source(0)
        accepted = accept(plan.suffix[0], plan.offered(0)) if source else 0
        planner.observe(plan, [accepted])
        ms, draft_ms = step_ms(plan.width, plan.run_draft)
        ms += rng.gauss(0.0, NOISE_MS)
        planner.observe_seconds(plan, 1, ms / 1000, draft_ms / 1000)
        tally.add(source, accepted, plan.expected[0] if source else 0.0, ms)
        index.extend(out[done : done + accepted + 1])
        done += accepted + 1
    shared.add(row["prompt_ids"], out)


class Hindsight:
    """Each step the width, drafter on/off and source that emit the most tokens per ms,
    knowing what each would accept (`decode` sets `accept`): a bound no planner reaches,
    for scale."""

    def __init__(self, block_size: int, widths, cost, **_) -> None:
        self.widths = tuple(widths)
        self.accept = None

    def plan(self, proposals) -> StepPlan:
        best: tuple[float, StepPlan] | None = None
        for width in self.widths:
            for run_draft in (False, True) if width > 1 else (False,):
                options = [*proposals[0], None] if run_draft else list(proposals[0])
                scored = [(self.accept(p, width - 1), p) for p in options]
                n, p = max(scored, key=lambda s: s[0], default=(0, None))
                score = (n + 1) / step_ms(width, run_draft and p is None)[0]
                if best is None or score > best[0]:
                    drafts = run_draft and p is None
                    plan = StepPlan(width, drafts, (p,), 0.0, expected=(float(n),))
                    best = (score, plan)
        return best[1]

    def observe(self, *args, **kwargs) -> None:
        pass

    def observe_seconds(self, *args, **kwargs) -> None:
        pass


@functools.cache
def _warm_documents() -> list[tuple[list[int], list[int]]]:
    """The bundled corpus the default launch warms its shared index from, read once."""
    return suffix_corpus.documents(suffix_corpus.read(suffix_corpus.bundled()))


def replay(planner_class, rows: list[dict], sets: list[str], seed: int) -> dict[str, dict]:
    """Every set's replies through one planner and one warm shared index, as a server."""
    options = SpecOptions()
    planner = planner_class(
        BLOCK,
        options.candidate_widths(BLOCK),
        CostModel(DEFAULT_CPU_PRIOR),
        max_match=options.suffix_max_match,
        explore_every=options.explore_every,
        explore_budget=options.explore_budget,
    )
    shared = SharedSuffixIndex(
        options.shared_tokens, options.suffix_max_match, options.max_proposal(BLOCK)
    )
    shared.warm(_warm_documents())
    rng = random.Random(seed)
    result = {}
    for name in sets:
        tally = Tally()
        for row in (r for r in rows if r["source"] == name):
            decode(planner, options, shared, row, tally, rng)
        result[name] = tally.summary()
    return result


class _Split(Planner):
    """This tree's planner with some statistics kept per context of the (one) request: a
    variant replayed to see whether it would pay, not served."""

    split: tuple[str, ...] = ()  # which of "dflash", "suffix", "shared" are kept per context

    def key(self, cands: tuple[SuffixProposal, ...], last: int) -> int:
        raise NotImplementedError

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pooled = {name: getattr(self, name) for name in ("dflash", "suffix", "shared")}
        self._banks: dict[int, dict] = {}
        self._last = self._key = 0  # accepted on the request's last step; this step's key

    def _use(self, key: int) -> None:
        if key not in self._banks:
            fresh = Planner(self.block_size, self.widths, self.cost, max_match=len(self.suffix))
            self._banks[key] = {name: getattr(fresh, name) for name in self.split}
        for name, stats in (self._pooled | self._banks[key]).items():
            setattr(self, name, stats)

    def plan(self, proposals):
        self._key = self.key(candidates(proposals[0]), self._last)
        self._use(self._key)
        return super().plan(proposals)

    def observe(self, plan, accepted, branches=None) -> None:
        self._use(self._key)
        super().observe(plan, accepted, branches)
        self._last = accepted[0] if plan.source(0) else 0


class DFlashByMatch(_Split):
    """The DFlash block's acceptance per longest suffix match the request has (0: none):
    where a lookup matches long the text is predictable and the block accepts more too."""

    split = ("dflash",)

    def key(self, cands, last):
        return max((p.match_len for p in cands), default=0)


class ByLastStep(_Split):
    """Every source's acceptance per the request's last step (0, 1, 2, 3+ accepted):
    acceptance comes in bursts."""

    split = ("dflash", "suffix", "shared")

    def key(self, cands, last):
        return min(last, 3)


VARIANTS = {"dflash_by_match": DFlashByMatch, "by_last_step": ByLastStep, "hindsight": Hindsight}


def base_planner(rev: str):
    """`Planner` as `dflash_sglang/proposals.py` defines it at git revision `rev`."""
    try:
        source = subprocess.run(
            ["git", "show", f"{rev}:dflash_sglang/proposals.py"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"--base {rev}: {e.stderr.strip()}") from e
    name = "proposals_at_base"
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    sys.modules[name] = module  # dataclasses resolve annotations through it
    exec(compile(source, f"{rev}:dflash_sglang/proposals.py", "exec"), module.__dict__)
    return module.Planner


def mean_over_seeds(runs: list[dict[str, dict]]) -> dict[str, dict]:
    """Per set: mean x_plain and τ over seeds, with their ranges, and the first seed's sources."""
    out = {}
    for name in runs[0]:
        per = [r[name] for r in runs]
        out[name] = {
            key: {
                "mean": statistics.fmean(p[key] for p in per),
                "range": [min(p[key] for p in per), max(p[key] for p in per)],
            }
            for key in ("x_plain", "tau")
        } | {"tokens": per[0]["tokens"], "sources_seed0": per[0]["sources"]}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tables", help="DFlash acceptance at every response position")
    t.add_argument("--data", type=Path, default=HELDOUT)
    t.add_argument("--sets", default=",".join(SETS))
    t.add_argument("--drafter", type=Path, default=None, help="default: the bundled drafter")
    t.add_argument("--prompt-vocab", type=int, default=None, help="default: the server's")
    t.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("run", help="replay the planner over the tables")
    r.add_argument("--tables", type=Path, required=True)
    r.add_argument("--sets", default=",".join(SETS))
    r.add_argument("--base", help="git revision whose planner replays beside this tree's")
    r.add_argument("--variants", default="", help=f"planner variants too: {','.join(VARIANTS)}")
    r.add_argument("--seeds", type=int, default=3)
    r.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    sets = a.sets.split(",")
    if a.cmd == "tables":
        from dflash_sglang.drafters import default_draft_dir
        from dflash_sglang.options import DEFAULT_PROMPT_VOCAB

        if not a.data.is_file():
            ap.error(f"--data {a.data}: no such file")
        if a.drafter is not None and not (a.drafter / "config.json").is_file():
            ap.error(f"--drafter {a.drafter}: no drafter there (no config.json)")
        if a.prompt_vocab is not None and a.prompt_vocab < 0:
            ap.error(f"--prompt-vocab must be >= 0, got {a.prompt_vocab}")
        vocab = DEFAULT_PROMPT_VOCAB if a.prompt_vocab is None else a.prompt_vocab
        rows = tables(a.data, sets, a.drafter or Path(default_draft_dir()), vocab)
        with gzip.open(a.out, "wt") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        return
    if not a.tables.is_file():
        ap.error(f"--tables {a.tables}: no such file (make it with `tables`)")
    if a.seeds < 1:
        ap.error(f"--seeds must be >= 1, got {a.seeds}")
    with gzip.open(a.tables, "rt") as f:
        rows = [json.loads(line) for line in f]
    missing = set(sets) - {row["source"] for row in rows}
    if missing:
        ap.error(f"--sets: {sorted(missing)} not in {a.tables}")
    variants = [v for v in a.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"--variants: unknown {unknown}; choose from {','.join(VARIANTS)}")
    arms = {"this tree": Planner} | ({f"base {a.base}": base_planner(a.base)} if a.base else {})
    arms |= {v: VARIANTS[v] for v in variants}
    report = {"args": {k: str(v) for k, v in vars(a).items()}, "cost_ms": COST_MS, "arms": {}}
    for arm, planner_class in arms.items():
        runs = [replay(planner_class, rows, sets, seed) for seed in range(a.seeds)]
        report["arms"][arm] = mean_over_seeds(runs)
        for name, row in report["arms"][arm].items():
            x, t = row["x_plain"], row["tau"]
            print(
                f"{arm:>16} {name:>10}  x plain {x['mean']:.3f} ({x['range'][0]:.3f}-"
                f"{x['range'][1]:.3f})  tau {t['mean']:.3f}  "
                + "  ".join(
                    f"{s} {v['drafts']} {v['tau']:.2f}/{v['predicted_tau']:.2f}"
                    for s, v in row["sources_seed0"].items()
                )
            )
    if a.out:
        a.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
