"""The planner's invariants, checked after every step by tests and by ``--debug-checks``.

Kept apart from :mod:`scheduler_proc.planner` so that the planner reads as the
rules it follows; this module is the proof that it followed them.
"""

from __future__ import annotations

from scheduler_proc.request import Status

_RUNNING = Status.RUNNING
_FINISHED = Status.FINISHED


def check_planner(pl) -> None:
    """Assert every accounting invariant of the Planner ``pl`` (the planner imports this module, not the
    other way round); tests (and --debug-checks) call it after every step."""
    pl.blocks.check_integrity()
    pl.slots.check_integrity()
    in_flight: set[int] = set()  # requests with a row in a step in flight
    pending_count: dict[int, int] = {}
    lag_count: dict[int, int] = {}  # drafts of speculative rows in flight, per request
    for step in pl.inflight:
        for r, k in step.spec:
            lag_count[r.rid] = lag_count.get(r.rid, 0) + k
        rids = {r.rid for r in step.requests}
        assert len(rids) == len(step.requests), f"step {step.step_id}: a request twice"
        assert pl._returned < step.step_id < pl._next_step, f"step {step.step_id}: in flight out of order"
        in_flight |= rids
        for r in step.requests:
            assert r.last_step >= step.step_id, f"request {r.rid}: its last step is older than one in flight"
        for r in step.samplers:
            if r.status is not _FINISHED:
                pending_count[r.rid] = pending_count.get(r.rid, 0) + 1
    slot_owner = pl.slots.owned_by()
    running = list(pl._running.values())
    draining = list(pl.draining.values())
    holders = running + draining
    assert len({r.rid for r in holders}) == len(holders), "a request is both running and draining"
    holds = [0] * pl.blocks.size  # per block: the block tables and backups that hold it
    for r in holders:
        assert (r.last_step > pl._returned) == (r.rid in in_flight), f"request {r.rid}: steps in flight"
        assert len(set(r.blocks)) == len(r.blocks), f"request {r.rid}: a block twice in its table"
        assert min(r.blocks, default=0) >= 0, f"request {r.rid}: a negative block"
        for b in r.blocks:
            holds[b] += 1
        assert r.slot is not None and slot_owner.get(r.slot) == r.rid, f"request {r.rid}: slot ownership"
        # Exactly the blocks its KV needs: a decode row crosses into a new block when its position is a multiple.
        # A speculating request keeps the blocks of its rejected drafts (its next rows write there): at most the
        # worst case of the most steps that can be in flight (depth 2, one more with a prefill ahead) past its bound.
        need = -(-r.num_computed // pl.limits.block_size)
        if r.spec_k:
            most = -(-(r.num_computed + 4 * (r.spec_k + 1)) // pl.limits.block_size)
            assert need <= len(r.blocks) <= most, f"request {r.rid}: blocks for its KV and drafts"
        else:
            assert len(r.blocks) == need, f"request {r.rid}: blocks for its KV"
        assert r.spec_lag == lag_count.get(r.rid, 0), f"request {r.rid}: drafts in flight"
    if pl.host is not None:  # a device block being backed up holds one more reference
        busy = pl.host.busy_device_blocks()
        assert min(busy, default=0) >= 0, "a negative block backed up"
        for b in busy:
            holds[b] += 1
        pl.host.check([h for step in pl.inflight for h in step.onloaded])
    refs = pl.blocks.ref_counts()
    assert holds == refs, "block reference counts differ from the requests' block tables and backups"
    if pl.prefix is not None:
        pl.prefix.check(holders)
    else:
        assert max(refs) <= 1, "a block is shared without prefix caching"
    assert len(slot_owner) == len(holders), "a slot is owned by a request that holds none"
    assert pl._draining_blocks == sum([len(r.blocks) for r in draining]), "draining blocks"
    for r in draining:
        assert r.status is Status.PREEMPTED or r.status is _FINISHED, f"request {r.rid}: draining while {r.status}"
    for r in running:
        assert r.status is _RUNNING
        # prompt, received and sampled tokens in flight (every draft in flight counted as accepted)
        total = r.num_known + pending_count.get(r.rid, 0) + r.spec_lag
        assert r.num_computed <= total
        if not r.is_prefilling:
            assert r.num_computed == total - 1, f"request {r.rid}: decode invariant"
        assert (r.rid in pl._prefilling) == r.is_prefilling, f"request {r.rid}: prefilling set"
        if r.spec_k:  # speculating: in the set from its prompt's end (if it wanted a token) to its finish
            paused = r.rid in pl._paused  # or, pausing, in the decoding set once its drafts are back
            assert not (r.rid in pl._decoding and r.rid in pl._speculating) and not (paused and r.is_prefilling)
            assert r.rid not in pl._decoding or (paused and not r.spec_lag), f"request {r.rid}: decoding set"
            assert not (r.is_prefilling and r.rid in pl._speculating)
            wants = not r.is_prefilling and r.num_computed + 1 - r.spec_lag < r.max_total
            assert r.rid in pl._speculating or not wants or (paused and r.rid in pl._decoding), \
                f"request {r.rid}: speculating set"
        else:
            wants_decode = not r.is_prefilling and r.num_computed + 1 < r.max_total
            assert (r.rid in pl._decoding) == wants_decode, f"request {r.rid}: decoding set"
            assert r.rid not in pl._speculating and not r.spec_lag, f"request {r.rid}: speculating set"
    assert pl._prefilling.keys() <= pl._running.keys() and pl._decoding.keys() <= pl._running.keys()
    assert pl._speculating.keys() <= pl._running.keys() and pl._paused.keys() <= pl._running.keys()
    live = running + list(pl.waiting) + [r for r in draining if r.status is not _FINISHED]
    assert set().union(*[r.stop_ids for r in live]) <= pl._stop_tokens, "a live request's stop token is missed"
    assert pl.limits.eos_token_ids <= pl._stop_tokens
    for r in pl.waiting:
        assert r.status is Status.WAITING and r.slot is None and not r.blocks
        assert r.rid not in pending_count and r.last_step <= pl._returned
