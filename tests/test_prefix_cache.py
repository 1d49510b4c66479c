"""Prefix cache: hits reuse KV exactly (fp32 CPU, greedy), tenants never share, blocks stay consistent."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from governor.engine import LLM, SamplingParams
from governor.engine.kv.block_hash import chain_hashes, identity_seed
from governor.engine.kv.block_pool import BlockPool
from tests.test_engine_parity import greedy


@pytest.fixture(scope="module")
def model(hf_checkpoint) -> Path:
    return hf_checkpoint("llama")


def shared_prefix_prompts(prefix_len: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(2, 2000) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(2, 2000) for _ in range(rng.randint(1, 20))] for _ in range(n)]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("budget", [7, 16, 64])
@pytest.mark.parametrize("prefix_len", [5, 16, 31, 32, 40])
def test_cache_hits_give_exactly_the_cold_tokens(model: Path, prefix_len: int, budget: int) -> None:
    prompts = shared_prefix_prompts(prefix_len, 4, seed=prefix_len)
    cold = LLM(str(model), dtype="float32", block_size=8, max_num_batched_tokens=budget)
    want = tokens(cold.generate(prompts, greedy(12)))
    warm = LLM(str(model), dtype="float32", block_size=8, max_num_batched_tokens=budget, enable_prefix_caching=True)
    first = warm.generate(prompts[:1], greedy(12))
    assert tokens(first) == want[:1]
    got = tokens(warm.generate(prompts, greedy(12)))
    assert got == want
    stats = warm.stats()
    full_prefix_blocks = prefix_len // 8
    assert stats["prefix_cache_hit_tokens"] >= 4 * full_prefix_blocks * 8
    assert stats["prefix_cache_queries"] == sum(len(p) for p in prompts[:1] + prompts)
    assert stats["kv_blocks_used"] == 0


def test_a_repeated_prompt_recomputes_only_its_last_block(model: Path) -> None:
    prompt = list(range(10, 42))  # 32 tokens = 4 full blocks of 8
    llm = LLM(str(model), dtype="float32", block_size=8, enable_prefix_caching=True)
    a = llm.generate([prompt], greedy(6))
    before = llm.stats()["prefix_cache_hit_tokens"]
    b = llm.generate([prompt], greedy(6))
    assert tokens(a) == tokens(b)
    assert llm.stats()["prefix_cache_hit_tokens"] - before == 24  # 3 of 4 blocks: the last one yields logits


def test_different_cache_salts_never_share_blocks(model: Path) -> None:
    prompt = list(range(100, 148))
    llm = LLM(str(model), dtype="float32", block_size=8, enable_prefix_caching=True)
    llm.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}], greedy(2))
    hits0 = llm.stats()["prefix_cache_hit_tokens"]
    llm.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-b"}], greedy(2))
    assert llm.stats()["prefix_cache_hit_tokens"] == hits0
    llm.generate([{"prompt_token_ids": prompt}], greedy(2))  # no salt is a tenant of its own too
    assert llm.stats()["prefix_cache_hit_tokens"] == hits0
    llm.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}], greedy(2))
    assert llm.stats()["prefix_cache_hit_tokens"] == hits0 + 40


def test_block_hashes_depend_on_every_identity_part_and_the_whole_prefix() -> None:
    base = ("sha256:m", "sha256:t", "", "torch.float32", None)
    seeds = {identity_seed(*base)}
    for i, other in enumerate(("sha256:m2", "sha256:t2", "lora", "torch.float8_e4m3fn", "salt")):
        parts = list(base)
        parts[i] = other
        seeds.add(identity_seed(*parts))
    assert len(seeds) == 6
    seed = identity_seed(*base)
    a = chain_hashes(seed, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = chain_hashes(seed, [9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same second block, different prefix
    assert chain_hashes(seed, [1, 2, 3], 4) == []  # partial blocks are never cached


def test_least_recently_freed_cached_block_is_evicted_first() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.register(a, b"A")
    pool.register(b, b"B")
    pool.free([b, a])  # b freed first → evicted first
    assert pool.lookup([b"A", b"B"]) == [a, b]  # freed blocks stay findable until evicted
    pool.allocate(2)  # takes the two never-cached blocks
    pool.allocate(1)
    assert pool.lookup([b"B"]) == [] and pool.lookup([b"A"]) == [a]
    pool.check_invariants()


def test_touching_a_free_cached_block_revives_it() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.register(a, b"A")
    pool.free([a])
    assert pool.num_free == 2 and pool.num_cached == 1
    pool.touch(pool.lookup([b"A"]))
    assert pool.num_free == 1 and pool.ref_counts[a] == 1
    pool.check_invariants()


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prefix_len=st.integers(0, 30),
    n=st.integers(1, 6),
    max_num_seqs=st.integers(1, 4),
    budget=st.integers(1, 40),
    spare=st.integers(0, 8),
    seed=st.integers(0, 1000),
)
def test_prefix_cache_under_preemption_keeps_outputs_and_invariants(model: Path, prefix_len, n, max_num_seqs,
                                                                    budget, spare, seed) -> None:
    prompts = shared_prefix_prompts(prefix_len, n, seed)
    max_model_len = 64
    kwargs = dict(dtype="float32", block_size=4, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=budget, num_kv_blocks=max_model_len // 4 + spare)
    want = tokens(LLM(str(model), **kwargs).generate(prompts, greedy(8)))
    llm = LLM(str(model), enable_prefix_caching=True, **kwargs)
    eng = llm.engine
    for rnd in range(2):  # the second round runs over a warm cache
        for i, p in enumerate(prompts):
            eng.add_request(f"{rnd}-{i}", p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        outs = {}
        while eng.has_unfinished_requests():
            for o in eng.step().finished:
                outs[o.request_id] = o
            eng.kv.check_invariants(eng.scheduler.running)
            holders = Counter(b for s in eng.scheduler.running for b in s.block_table)
            assert all(eng.kv.pool.ref_counts[b] == c for b, c in holders.items())
            assert len(holders) == eng.kv.pool.num_used
        assert [outs[f"{rnd}-{i}"].outputs[0].token_ids for i in range(n)] == want
        assert llm.stats()["kv_blocks_used"] == 0


def test_prefill_chunks_end_on_block_boundaries_unless_alignment_is_off(model: Path) -> None:
    prompt = list(range(10, 60))  # 50 tokens, blocks of 8, budget 20
    for align, want in ((True, [16, 16, 18]), (False, [20, 20, 10])):  # the last chunk finishes the prompt
        llm = LLM(str(model), dtype="float32", block_size=8, max_num_batched_tokens=20, align_prefill_chunks=align)
        eng = llm.engine
        eng.add_request("r", prompt, greedy(1))
        chunks = []
        while eng.has_unfinished_requests():
            out = eng.scheduler.schedule()
            chunks += [s.num_new_tokens for s in out.scheduled]
            eng.scheduler.update_from_output(out)  # the chunk counts as computed without running the model
            if sum(chunks) >= len(prompt):
                eng.abort("r")
        assert chunks == want
