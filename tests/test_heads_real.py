"""The shipped EAGLE and Medusa heads and the DFlash drafter (dflash) on the real embedded SmolLM2-135M
(float32, and the DFlash drafter also in bfloat16 exact mode): greedy output equals plain greedy decoding
token for token (5 prompts x 64 tokens), as chains and trees, and the heads really draft (some drafts
accepted)."""

from __future__ import annotations

import pytest
import torch

from verispec.api import build_engine
from verispec.heads import shipped_head
from verispec.types import SamplingParams

pytestmark = pytest.mark.real_model

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea.",
    "Natalie has 12 apples and gives 5 to her friend. How many apples does she have left? Explain step by step.",
    "Explain what a hash table is to a beginner programmer.",
    "List three tips for staying productive when working from home.",
]


@pytest.fixture(scope="module")
def plain(smollm2):
    engine = build_engine(smollm2, "ar")
    return [engine.generate(smollm2.encode(chat=p), SamplingParams(max_new_tokens=64)).token_ids for p in PROMPTS]


def test_heads_are_shipped_and_small():
    for kind in ("eagle", "medusa"):
        path = shipped_head("smollm2-135m", kind)
        assert path is not None, f"no shipped {kind} head"
        assert (path / "model.safetensors").stat().st_size <= 20 * 2**20
    path = shipped_head("smollm2-135m", "dflash")
    assert path is not None, "no shipped dflash drafter"
    assert (path / "model.safetensors").stat().st_size <= 30 * 2**20


def test_shipped_dflash_drafter_greedy_exact_bfloat16():
    """The DFlash drafter as it ships (bf16 target with the default weights: the file's q4 where qmm runs,
    else packed bf16; exact mode): output equals plain decoding's, as a whole block (draft length B-1) and
    as a tree."""
    from verispec.models import load_model

    target = load_model("smollm2-135m", dtype="bfloat16")
    plain = build_engine(target, "ar")
    for tree in (None, "dynamic"):
        engine = build_engine(target, "dflash", draft_length=7, tree=tree)
        accepted = 0
        for prompt in PROMPTS[:3]:
            ids = target.encode(chat=prompt)
            g = engine.generate(ids, SamplingParams(max_new_tokens=64))
            assert g.token_ids == plain.generate(ids, SamplingParams(max_new_tokens=64)).token_ids, (tree, prompt)
            accepted += g.stats.accepted
        assert accepted > 0


@pytest.mark.parametrize("method,tree", [("eagle", None), ("eagle", "dynamic"), ("medusa", None),
                                         ("medusa", "static:medium"), ("dflash", None), ("dflash", "dynamic")])
def test_shipped_heads_greedy_exact(smollm2, plain, method, tree):
    engine = build_engine(smollm2, method, draft_length=4, tree=tree)
    accepted = 0
    for prompt, want in zip(PROMPTS, plain):
        g = engine.generate(smollm2.encode(chat=prompt), SamplingParams(max_new_tokens=64))
        assert g.token_ids == want, prompt
        accepted += g.stats.accepted
    assert accepted > 0  # a trained head gets drafts accepted (a broken feature hook would get ~none)


@torch.inference_mode()
def test_training_windows_equal_the_shipped_drafter_on_a_long_prompt(tmp_path):
    """On a prompt of 300+ tokens, the training pipeline's window (features extracted by the training
    pass, FeatureSet.batch, the training-time unroll) gives at every answer position the logits the
    shipped EAGLE drafter computes at inference (EagleDrafter.for_target: bf16, packed weights; the
    target's features from its exact-mode incremental passes). Windows that do not reach back to
    position 0, as the training windows of old, are far off on such a prompt (checked below)."""
    from verispec.bench.prompts import load_prompts
    from verispec.drafters.eagle import EagleDrafter
    from verispec.backends.fast import FastRunner
    from verispec.models import load_model
    from verispec.train.extract import FeatureSet, extract_features
    from verispec.train.loops import eagle_unroll

    target = load_model("smollm2-135m", dtype="bfloat16")
    text = next(q.turns[0] for q in load_prompts("spec_bench") if q.category == "summarization")
    prompt = target.encode(chat=text)
    assert len(prompt) > 300
    answer = build_engine(target, "ar").generate(prompt, SamplingParams(max_new_tokens=24)).token_ids
    seq = prompt + answer
    drafter = EagleDrafter.for_target(target)
    head = drafter.head
    L = target.model.config.num_hidden_layers
    data = FeatureSet(extract_features(target, [{"id": "long", "source": "test", "prompt_ids": prompt, "answer_ids": answer}],
                                       tmp_path, sorted(set(head.feature_layers) | {L}), progress=False, backend="fast"))
    batch = data.batch([0], seq_len=len(answer), rng=torch.Generator().manual_seed(0))
    anchors = batch["anchors"][0][batch["anchor_mask"][0]]
    assert anchors[0] == len(prompt) - 2 and anchors[-1] == len(seq) - 3  # every anchor with an answer label
    cols = data.columns(head.feature_layers, head.embed.shape[1])
    feats = batch["feats"].index_select(-1, cols)
    train = eagle_unroll(head, batch["tokens"], feats, 1, batch["anchors"])[0][0]  # [Q, Vd]

    # inference: the target's features as the engine hands them over, the drafter's own cache
    runner = FastRunner(target.model, exact=True)
    layers = tuple(head.feature_layers)
    runner.reset(SamplingParams())
    drafter.begin(prompt, SamplingParams(), None)
    drafter.observe_features(runner.forward(torch.tensor(prompt[:-2]), features=layers).features)
    got = {}
    for t in range(len(prompt) - 2, len(seq) - 2):  # anchor t: context seq[:t + 2]
        drafter.observe_features(runner.forward(torch.tensor([seq[t]]), features=layers).features)
        got[t] = head.logits(drafter.sync(seq[: t + 2]))
    rows = [(c, int(a)) for c, a in enumerate(batch["anchors"][0].tolist()) if batch["anchor_mask"][0, c] and int(a) in got]
    assert len(rows) == len(answer)
    diffs = torch.stack([(train[c] - got[a]).abs().max() for c, a in rows])
    same_top = sum(int(train[c].argmax() == got[a].argmax()) for c, a in rows)
    assert float(diffs.max()) < 0.5 and same_top >= len(rows) - 1, (diffs.tolist(), same_top)

    # the old windows: keys from 16 tokens before the answer only
    lo = len(prompt) - 16
    short = eagle_unroll(head, batch["tokens"][:, lo:], feats[:, lo:], 1, batch["anchors"] - lo)[0][0]
    far = max(float((short[c] - got[a]).abs().max()) for c, a in rows)
    assert far > 4 * float(diffs.max()), (far, diffs.max())
