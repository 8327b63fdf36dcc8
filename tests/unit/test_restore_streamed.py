"""The restore recipe's streamed checkout (``stream_restore``), over the fakes: CRIU is given
the images to read as it asks for them when it can, and an image directory otherwise."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ckptd.errors import CriuFailed

from .world import JOB, JOB_TREE, World


def _die(world: World) -> None:
    for pid in JOB_TREE:
        world.processes.remove(pid)


def test_a_criu_that_streams_reads_the_images_from_the_store(world: World) -> None:
    world.criu.streams_restore = True
    record = world.dump(JOB)
    outcome = world.restore(checkpoint_id=record.id)
    assert outcome.pid == JOB
    assert world.states(*JOB_TREE) == ["running"] * 3
    (job,) = world.criu.restore_jobs
    assert job.images is not None and job.images.checkpoint_id == record.id
    assert job.images_dir != world.store.images_dir(record.id)
    assert not job.images_dir.exists()  # its own directory, gone with the restore
    assert world.store.open_checkouts == 0


def test_without_a_streaming_criu_or_with_the_option_off_the_images_are_written_first(
    world: World,
) -> None:
    record = world.dump(JOB)
    world.restore(checkpoint_id=record.id)  # this CRIU cannot stream
    _die(world)
    world.criu.streams_restore = True
    world.restore_recipe._config = replace(world.config, stream_restore=False)
    world.restore(checkpoint_id=record.id)
    for job in world.criu.restore_jobs:
        assert job.images is None
        assert job.images_dir == world.store.images_dir(record.id)


def test_captured_files_are_written_out_and_put_back_before_criu_streams(world: World) -> None:
    world.criu.streams_restore = True
    log = world.tmp / "job" / "train.log"
    log.parent.mkdir(parents=True)
    log.write_bytes(b"step 1\n")
    world.files.open_for_writing(JOB, log)
    record = world.dump(JOB, leave_running=True)
    log.write_bytes(b"step 1\nstep 2\n")
    _die(world)
    outcome = world.restore(checkpoint_id=record.id)
    assert log.read_bytes() == b"step 1\n"
    assert outcome.files_put_back == (str(log),)
    (job,) = world.criu.restore_jobs
    assert job.images is not None
    assert world.events.index(f"files.put_back {log}") < world.events.index("criu.restore")


def test_a_failed_streamed_restore_releases_the_checkout(world: World) -> None:
    world.criu.streams_restore = True
    record = world.dump(JOB)
    world.criu.fail_restore = CriuFailed("CRIU restore failed: Reached EOF unexpectedly")
    with pytest.raises(CriuFailed):
        world.restore(checkpoint_id=record.id)
    assert world.store.open_checkouts == 0
    assert world.states(*JOB_TREE) == ["free"] * 3
    assert world.store.get(record.id) == record
