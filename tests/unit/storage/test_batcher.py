"""GroupCommitter: batching, per-item outcomes, failures and draining on close."""

from __future__ import annotations

import asyncio

import pytest

from core.errors import InvalidArgument, StorageError, Unavailable
from storage.batcher import GroupCommitter


class Recorder:
    def __init__(self, fail_with: Exception | None = None) -> None:
        self.batches: list[list[int]] = []
        self.fail_with = fail_with

    async def process(self, items: list[int]) -> list[int | BaseException]:
        self.batches.append(items)
        if self.fail_with is not None:
            raise self.fail_with
        return [InvalidArgument("odd") if i % 2 else i * 10 for i in items]


async def test_concurrent_submits_form_one_batch_in_submit_order() -> None:
    recorder = Recorder()
    committer = GroupCommitter(recorder.process, max_weight=100, linger=0, name="t")
    results = await asyncio.gather(*(committer.submit(i) for i in range(0, 20, 2)))
    assert results == [i * 10 for i in range(0, 20, 2)]
    assert recorder.batches == [list(range(0, 20, 2))] and committer.commits == 1
    await committer.close()


async def test_batches_are_bounded_by_weight() -> None:
    recorder = Recorder()
    committer = GroupCommitter(recorder.process, max_weight=5, linger=0, name="t")
    await asyncio.gather(*(committer.submit(i, weight=2) for i in range(0, 12, 2)))
    assert recorder.batches == [[0, 2], [4, 6], [8, 10]]
    await committer.close()


async def test_an_item_can_fail_alone() -> None:
    committer = GroupCommitter(Recorder().process, max_weight=10, linger=0, name="t")
    ok, odd = await asyncio.gather(committer.submit(2), committer.submit(3), return_exceptions=True)
    assert ok == 20 and isinstance(odd, InvalidArgument)
    await committer.close()


@pytest.mark.parametrize("error", [StorageError("db down"), RuntimeError("bug")])
async def test_a_failed_batch_fails_every_caller_with_storage_error(error: Exception) -> None:
    recorder = Recorder(fail_with=error)
    committer = GroupCommitter(recorder.process, max_weight=10, linger=0, name="t")
    results = await asyncio.gather(committer.submit(2), committer.submit(4), return_exceptions=True)
    assert all(isinstance(r, StorageError) for r in results)
    recorder.fail_with = None
    assert await committer.submit(6) == 60
    await committer.close()


async def test_close_writes_what_was_submitted_then_refuses_more() -> None:
    recorder = Recorder()
    committer = GroupCommitter(recorder.process, max_weight=10, linger=0.01, name="t")
    # gather starts its tasks in order: the submit happens before close runs.
    result, _ = await asyncio.gather(committer.submit(8), committer.close())
    assert result == 80 and recorder.batches == [[8]]
    with pytest.raises(Unavailable):
        await committer.submit(2)
