"""Grouped dispatch at long context: buckets up to 8,192 tokens, one launch per bucket.

kernels.grouped takes any increasing bucket list (no limit of its own); the long-context
list used in docs/rebalancing.md is checked here through the plan and the config."""

from bert.config import ModelSection
from kernels.grouped import plan_groups

LONG_BUCKETS = [128, 256, 512, 1024, 2048, 4096, 8192]


def test_buckets_reach_8192():
    seqlens = [8192, 600, 3, 8191, 4097, 2048, 130, 8192]
    plan = plan_groups(seqlens, LONG_BUCKETS)
    groups = [(g.start, g.count, g.max_len) for g in plan.groups]
    # largest bucket first; inside a group the batch order: (8192, 8191, 4097 -> 8192), ...
    assert groups == [(0, 4, 8192), (4, 1, 2048), (5, 1, 600), (6, 1, 130), (7, 1, 3)]
    assert plan.order.tolist() == [0, 3, 4, 7, 5, 1, 6, 2]


def test_longer_than_the_last_bucket_is_one_more_group():
    plan = plan_groups([9000, 100, 8192], LONG_BUCKETS)
    assert [(g.count, g.max_len) for g in plan.groups] == [(1, 9000), (1, 8192), (1, 100)]


def test_the_config_takes_the_long_context_buckets():
    section = ModelSection(attention="triton_grouped", attention_options={"buckets": LONG_BUCKETS})
    assert section.attention_options == {"buckets": LONG_BUCKETS}
