"""Speculative decoding with a random-weight draft model on the default model (CPU, float32): next to no draft is
accepted, and the output is identical token for token at pipeline depths 0, 1 and 2 (greedy and seeded sampled
requests; the servers and checks of ``tests/test_spec_draft_e2e.py``)."""

from __future__ import annotations

from tests.test_gpu_fastpath import write_config
from tests.test_spec_draft_e2e import identical_at_every_depth


async def test_a_random_draft_changes_no_output(module_servers, tmp_path_factory):
    tiny = write_config(tmp_path_factory.mktemp("draft"), vocab=49152)  # 2 layers, the default model's vocabulary
    counts = await identical_at_every_depth(module_servers, "--draft-model", tiny, "--draft-load-format", "dummy")
    for depth, (drafted, accepted) in counts.items():
        assert accepted <= 0.1 * drafted, (depth, drafted, accepted)
