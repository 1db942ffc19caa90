"""Scheduler with toy sizes: continuous batching, chunked prefill, prefix hits, preemption."""

from kvserve.engine.block_pool import BlockPool
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.scheduler import Scheduler
from kvserve.sampling_params import SamplingParams


def make(num_blocks=8, block_size=4, max_num_seqs=4, budget=64, max_model_len=64):
    return Scheduler(BlockPool(num_blocks, block_size), max_num_seqs, budget, max_model_len)


def req(rid, n, max_tokens=4, **kw):
    return Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=max_tokens, temperature=0, **kw), (2,))


def step(s, tokens=None):
    out = s.schedule()
    sampled = {x.request_id: (tokens or {}).get(x.request_id, 7) for x in out.scheduled if x.sample}
    s.update_from_output(out, sampled)
    return out


def test_prefill_then_decode_with_exact_blocks():
    s = make()
    s.add_request(req("a", 6))
    s.add_request(req("b", 3))
    out = step(s)
    assert [(x.request_id, x.num_computed_tokens, len(x.token_ids), x.block_ids, x.sample) for x in out.scheduled] == [
        ("a", 0, 6, [0, 1], True),
        ("b", 0, 3, [2], True),
    ]
    out = step(s)
    assert [(x.request_id, x.num_computed_tokens, x.token_ids, x.block_ids) for x in out.scheduled] == [
        ("a", 6, [7], [0, 1]),
        ("b", 3, [7], [2]),
    ]
    out = step(s)  # b's 5th token needs a second block
    assert [x.block_ids for x in out.scheduled] == [[0, 1], [2, 3]]


def test_chunked_prefill_under_token_budget_mixes_with_decode():
    s = make(budget=5)
    s.add_request(req("a", 2))
    step(s)  # a prefilled, has one output token
    s.add_request(req("b", 10))
    out = step(s)
    assert [(x.request_id, len(x.token_ids), x.sample) for x in out.scheduled] == [("a", 1, True), ("b", 4, False)]
    out = step(s)
    assert [(x.request_id, x.num_computed_tokens, len(x.token_ids), x.sample) for x in out.scheduled] == [
        ("a", 3, 1, True),
        ("b", 4, 4, False),
    ]
    out = step(s)
    assert [(x.request_id, x.num_computed_tokens, len(x.token_ids), x.sample) for x in out.scheduled] == [
        ("a", 4, 1, True),
        ("b", 8, 2, True),
    ]


def test_max_num_seqs_limits_the_running_batch():
    s = make(max_num_seqs=2)
    for rid in "abc":
        s.add_request(req(rid, 2))
    out = step(s)
    assert [x.request_id for x in out.scheduled] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_stop_rules_finish_and_free():
    s = make()
    s.add_request(req("len", 3, max_tokens=2))
    s.add_request(req("eos", 3, max_tokens=8))
    s.add_request(req("min", 3, max_tokens=8, min_tokens=2))
    step(s, {"eos": 2, "min": 2})  # eos ends "eos" but not "min" (min_tokens)
    assert "eos" not in s.requests and "min" in s.requests
    step(s)
    assert "len" not in s.requests  # two tokens = max_tokens
    assert s.pool.num_used_blocks == 1  # only "min" holds a block
    s.pool.check_integrity()


def test_prefix_cache_hit_skips_computed_blocks():
    s = make(num_blocks=10)
    s.add_request(req("a", 10, max_tokens=1))
    step(s)
    assert s.pool.num_cached_blocks == 2  # two full blocks of a's prompt stay cached
    s.add_request(req("b", 11, max_tokens=1))  # same first 10 tokens
    out = step(s)
    (item,) = out.scheduled
    assert (item.num_computed_tokens, len(item.token_ids), item.block_ids[:2]) == (8, 3, [0, 1])
    assert s.stats.prefix_cache_hit_tokens_total == 8
    s.pool.check_integrity()
    assert s.pool.num_used_blocks == 0


def test_a_requests_tokens_between_two_positions_are_its_prompt_and_outputs_slice():
    r = req("a", 5)
    r.output_token_ids = [7, 8, 9]
    tokens = r.prompt_token_ids + r.output_token_ids
    for start in range(len(tokens) + 2):
        for end in range(start, len(tokens) + 3):
            assert r.token_ids_between(start, end) == tokens[start:end], (start, end)


def test_blocks_filled_by_a_prompt_and_its_outputs_are_hashed_as_the_whole_sequence():
    """A block's hash covers the tokens in it whether they came from the prompt or were sampled: a
    later prompt holding the whole conversation hits it."""
    s = make(num_blocks=10)
    s.add_request(req("a", 6, max_tokens=7))
    for token in (21, 22, 23, 24, 25, 26, 27):
        step(s, {"a": token})
    assert s.pool.num_cached_blocks == 3  # 12 of its 13 tokens, in three full blocks
    s.add_request(Request("b", [*range(100, 106), 21, 22, 23, 24, 25, 26, 3], SamplingParams(max_tokens=1)))
    (item,) = step(s).scheduled
    assert (item.num_computed_tokens, item.token_ids) == (12, [3])
    s.pool.check_integrity()
    assert s.pool.num_used_blocks == 0


def test_fully_cached_prompt_still_computes_its_last_token():
    s = make()
    s.add_request(req("a", 8, max_tokens=1))
    step(s)
    s.add_request(req("b", 8, max_tokens=1))
    (item,) = step(s).scheduled
    assert (item.num_computed_tokens, len(item.token_ids)) == (4, 4)


def test_preemption_by_recompute_when_blocks_run_out():
    s = make(num_blocks=4, block_size=2)
    s.add_request(req("a", 3, max_tokens=6))
    s.add_request(req("b", 3, max_tokens=6))
    step(s)  # a: blocks 0,1; b: blocks 2,3 (pool full)
    step(s)  # the 4th token of each still fits
    assert s.stats.num_preemptions_total == 0
    step(s)  # the 5th needs a third block each: b (admitted last) is preempted
    assert s.stats.num_preemptions_total == 1
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.block_ids == [] and b.num_computed_tokens == 0
    assert s.requests["a"].block_ids == [0, 1, 3]  # b's freed tail block (3) went to a
    while s.has_work:
        step(s)
    assert s.pool.num_used_blocks == 0
    s.pool.check_integrity()


def test_finish_requests_is_idempotent_and_frees_waiting_and_running():
    s = make()
    s.add_request(req("a", 3))
    step(s)
    s.add_request(req("b", 3))
    finished = s.finish_requests(["a", "b", "a", "zzz"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in finished] == ["a", "b"]
    assert all(r.finish_reason.value == "abort" for r in finished)
    assert not s.has_work and s.pool.num_used_blocks == 0
    s.pool.check_integrity()
