"""Speculative decoding with the models' own MTP layers (``--speculative-algorithm EAGLE``):
greedy identity with plain decoding on real ep=2 gloo ranks in every overlap mode, for the tiny
DeepSeek-V3 and GLM-4.5 (fp32, eight concurrent requests, prompts of 1, 37 and 200 tokens) and
MiMo-V2-Flash (four requests, the 200-token prompt past its 128-key window, so verify rows and
drafts lie beyond the window's edge), with verify steps run and drafts rejected (random weights
accept almost none); and the settings."""

from __future__ import annotations

import json

import pytest

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.model_config import ModelConfig as Config
from moe_overlap.engine.speculation import SpeculationStats
from tests.helpers import TINY, every_mode, force_overlap, glm4_hf_config, mimo_hf_config

NEW = 16
DEEPSEEK = ModelConfig(
    **(TINY["deepseek_v3"] | dict(num_nextn_predict_layers=1, max_position_embeddings=256))
)
GLM = Config.from_hf(
    glm4_hf_config(vocab_size=80, num_nextn_predict_layers=1, num_hidden_layers=2).to_dict()
)
MIMO = Config.from_hf(
    mimo_hf_config(num_nextn_predict_layers=1, max_position_embeddings=256, vocab_size=16).to_dict()
)  # 16 tokens: the random-weight model repeats itself, and some MTP drafts are accepted
GREEDY = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True)


def _prompts() -> list[list[int]]:
    lengths = [1, 37, 200, 5, 12, 20, 3, 30]  # eight requests at once
    return [[(11 * i * (j + 3) + 7 * j) % 80 for i in range(n)] for j, n in enumerate(lengths)]


def _identity(
    cfg: ModelConfig, modes: tuple[str, ...], spec: dict, prompts: list[list[int]] | None = None
) -> tuple[dict[str, int], SpeculationStats]:
    """Plain decoding's tokens, then MTP speculation's (``spec``: its settings) in each of
    ``modes``: the verify steps each ran (greedy identity asserted), and the counts."""
    prompts, configs, ran = prompts or _prompts(), every_mode(), {}
    with LLM(config=cfg, ep=2, seed=0, **spec) as llm:
        speculation, llm.scheduler.speculation = llm.scheduler.speculation, None
        want = [out.token_ids for out in llm.generate(prompts, GREEDY)]
        llm.scheduler.speculation = speculation
        for mode in modes:
            force_overlap(llm, configs[mode])
            before = speculation.stats.verifications
            got = [out.token_ids for out in llm.generate(prompts, GREEDY)]
            assert got == want, mode
            ran[mode] = speculation.stats.verifications - before
        stats = speculation.stats
    print(f"{cfg.model_type}: acceptance length {stats.mean_acceptance_length:.3f}, {ran}")
    assert stats.accepted_tokens < stats.draft_tokens  # drafts were rejected
    return ran, stats


def test_mtp_gives_plain_greedy_tokens_in_every_mode_at_ep2():
    # two steps from one MTP layer: the second reuses it (SGLang)
    spec = dict(speculative_algorithm="EAGLE", speculative_num_steps=2)
    ran, _ = _identity(DEEPSEEK, ("none", "tbo", "tbo+two-chunk", "sbo", "dbo"), spec)
    assert all(n > 0 for n in ran.values()), ran
    ran, _ = _identity(GLM, ("tbo",), spec | dict(speculative_num_steps=1))
    assert all(n > 0 for n in ran.values()), ran


def test_mimo_mtp_gives_plain_greedy_tokens_in_every_mode_at_ep2():
    # vLLM's method name for it; two steps from its one MTP layer: the second reuses it
    spec = dict(
        speculative_config=json.dumps({"method": "mimo_v2_mtp", "num_speculative_tokens": 2})
    )
    prompts = [[t % 16 for t in p] for p in _prompts() if len(p) in (1, 37, 200, 12)]
    ran, stats = _identity(MIMO, ("none", "tbo", "tbo+two-chunk", "sbo", "dbo"), spec, prompts)
    assert all(n > 0 for n in ran.values()), ran
    assert stats.accepted_tokens > 0  # verify steps that kept drafts, past the window too


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"speculative_algorithm": "EAGLE", "speculative_eagle_topk": 2}, "tree drafts"),
        ({"speculative_algorithm": "NEXTN", "speculative_num_steps": 2,
          "speculative_num_draft_tokens": 4}, "num-steps \\+ 1 = 3"),
        ({"speculative_algorithm": "NGRAM", "speculative_num_steps": 2}, "needs --speculative-alg"),
        ({"speculative_config": '{"method": "eagle", "num_speculative_tokens": 2}'}, "not one of"),
    ],
)  # fmt: skip
def test_bad_mtp_settings_are_refused(settings, match):
    with pytest.raises(ConfigError, match=match):
        LLM(config=DEEPSEEK, **settings)


def test_models_without_mtp_layers_are_refused():
    plain = ModelConfig(**TINY["deepseek_v3"])
    with pytest.raises(ConfigError, match="num_nextn_predict_layers is 0"):
        LLM(config=plain, speculative_algorithm="EAGLE")


def test_sglang_and_vllm_spellings_agree():
    for settings in (
        {"speculative_algorithm": "NEXTN", "speculative_num_steps": 2},
        {"speculative_config": '{"method": "deepseek_mtp", "num_speculative_tokens": 2}'},
        {"speculative_algorithm": "EAGLE", "speculative_num_draft_tokens": 3},
    ):
        with LLM(config=DEEPSEEK, **settings) as llm:
            config = llm.scheduler.speculation.config
            assert config.is_mtp and config.num_drafts == 2, settings
            assert llm.spec.mtp_steps == 2


def test_seeded_sampled_mtp_requests_are_reproducible_with_prefix_caching():
    """Seeded sampled requests drafted from the MTP head's q give the same tokens when run
    again, their prompts' pages cached by then: a hit's MTP entries are the ones its writer
    computed from the same tokens (``engine/page_keys.py``), so q, and the tokens, do not
    change (they did while the drafter kept a cache of its own, which a hit left unfilled)."""
    prompts = [p for p in _prompts() if len(p) > 16]
    sampled = SamplingParams(temperature=1.0, seed=3, max_new_tokens=12, ignore_eos=True)
    with LLM(config=DEEPSEEK, seed=0, speculative_algorithm="EAGLE", page_size=8) as llm:
        runs = [[out.token_ids for out in llm.generate(prompts, sampled)] for _ in range(3)]
        assert runs[1] == runs[0] and runs[2] == runs[0]
        assert sum(cache.hits for cache in llm.scheduler.prefix) > 0
