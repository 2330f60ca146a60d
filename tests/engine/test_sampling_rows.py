"""Sampling rows (issue 32 item 1): the scheduler fills one typed row per sampling thread and
the sampler packs them in one place; every sampling option must still pick the tokens the code
before the rows picked (``data/sampling_golden.json``, recorded from it by
``sampling_cases.py``): greedy, seeded sampling, top-k/p, min-p, the repetition, presence and
frequency penalties (per thread, forked threads included), end masks (``ignore_eos``,
``min_tokens``, stop ids), grammar masks, ``fork_threshold`` and a replay's forced tokens, in
mixed batches."""

from __future__ import annotations

import json

import pytest
import torch

from sampling_cases import GOLDEN, make_tagged_adapter, run_cases


@pytest.fixture(scope="module")
def results(tiny_llama, tmp_path_factory):
    adapter = make_tagged_adapter(tiny_llama, tmp_path_factory.mktemp("tagged") / "adapter")
    return run_cases(tiny_llama, adapter)


@pytest.mark.parametrize("case", ["mixed_options", "penalties", "end_masks", "replay", "grammar_forks",
                                  "fork_threshold"])
def test_every_sampling_option_picks_the_recorded_tokens(results, case):
    want = json.loads(GOLDEN.read_text())[case]
    got = results[case]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g["error"] is None and g["finish"] == w["finish"]
        assert g["token_ids"] == w["token_ids"] and g["threads"] == w["threads"]
        assert (g["logprobs"] is None) == (w["logprobs"] is None)
        if w["logprobs"] is not None:
            pairs = [(a, b) for a, b in zip(g["logprobs"], w["logprobs"]) if b is not None]
            assert [a is None for a in g["logprobs"]] == [b is None for b in w["logprobs"]]
            torch.testing.assert_close(torch.tensor([a for a, _ in pairs]), torch.tensor([b for _, b in pairs]),
                                       rtol=1e-5, atol=1e-5)


def test_the_cases_fork_and_mix_options(results):
    """The recorded cases exercise what they claim: forked threads under grammar masks and
    penalties, requests ending early under the end masks."""
    assert all(len(set(r["threads"])) > 1 for r in results["grammar_forks"])
    assert len(set(results["replay"][0]["threads"])) == 4
    assert {r["finish"] for r in results["end_masks"]} == {"stop", "length"}
