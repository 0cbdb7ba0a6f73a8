"""A run's time over its attempts (rewarduq_exp.runs.attempts): status.json's ``seconds`` is the sum of every attempt
of the run in its folder, and ``attempts`` lists each; a new run (another config, force=true, after a completed one)
starts a new list."""

import json

from rewarduq_exp.runs.run_folder import RunFolder


def status(folder) -> dict:
    return json.loads((folder / "status.json").read_text())


def interrupted_attempt(folder, chash="h1") -> dict:
    run = RunFolder(folder)
    run.start(chash)
    run.interrupt("interrupted by SIGTERM at step 3 of 9")
    return status(folder)


def test_a_resumed_run_sums_its_attempts(tmp_path):
    first = interrupted_attempt(tmp_path)
    assert [a["state"] for a in first["attempts"]] == ["interrupted"] and first["seconds"] == first["attempts"][0][
        "seconds"]
    second = interrupted_attempt(tmp_path)
    run = RunFolder(tmp_path)
    run.start("h1", threads=1)
    assert [a["state"] for a in status(tmp_path)["attempts"]] == ["interrupted", "interrupted"]  # while it runs
    run.finish(fit={})
    done = status(tmp_path)
    assert [a["state"] for a in done["attempts"]] == ["interrupted", "interrupted", "completed"]
    assert done["attempts"][:2] == second["attempts"]
    assert done["seconds"] == round(sum(a["seconds"] for a in done["attempts"]), 2)
    assert done["attempts"][-1]["started_at"] == done["started_at"] and done["threads"] == 1
    assert all(set(a) == {"started_at", "ended_at", "seconds", "state"} for a in done["attempts"])


def test_an_attempt_killed_without_a_word_counts_to_its_last_heartbeat(tmp_path):
    (tmp_path / "status.json").write_text(json.dumps({
        "state": "running", "config_hash": "h1", "host": "a-node-that-is-gone", "pid": 1,
        "started_at": "2026-01-01T10:00:00+0000", "heartbeat_at": "2026-01-01T10:01:40+0000",
        "heartbeat_every_s": 1, "attempts": [{"started_at": "2026-01-01T09:00:00+0000", "seconds": 20.0,
                                              "ended_at": "2026-01-01T09:00:20+0000", "state": "interrupted"}]}))
    run = RunFolder(tmp_path)
    run.start("h1")
    run.fail(RuntimeError("boom"))
    attempts = status(tmp_path)["attempts"]
    assert [a["state"] for a in attempts] == ["interrupted", "lost", "failed"]
    assert attempts[1] == {"started_at": "2026-01-01T10:00:00+0000", "ended_at": "2026-01-01T10:01:40+0000",
                           "seconds": 100.0, "state": "lost"}
    assert status(tmp_path)["seconds"] == round(120.0 + attempts[2]["seconds"], 2)


def test_a_status_written_before_attempts_were_recorded_counts_as_one_attempt(tmp_path):
    (tmp_path / "status.json").write_text(json.dumps({
        "state": "interrupted", "config_hash": "h1", "started_at": "2026-01-01T10:00:00+0000", "seconds": 42.5,
        "interrupted_at": "2026-01-01T10:00:43+0000"}))
    run = RunFolder(tmp_path)
    run.start("h1")
    run.finish()
    attempts = status(tmp_path)["attempts"]
    assert attempts[0] == {"started_at": "2026-01-01T10:00:00+0000", "ended_at": "2026-01-01T10:00:43+0000",
                           "seconds": 42.5, "state": "interrupted"}
    assert len(attempts) == 2


def test_damaged_attempts_count_zero_seconds(tmp_path):
    (tmp_path / "status.json").write_text(json.dumps({
        "state": "failed", "config_hash": "h1", "attempts": [{"seconds": "a lot"}, {"seconds": -5}, 7, {}]}))
    run = RunFolder(tmp_path)
    run.start("h1")
    run.finish()
    attempts = status(tmp_path)["attempts"]
    assert [a["seconds"] for a in attempts[:3]] == [0.0, 0.0, 0.0] and len(attempts) == 4


def test_another_config_force_or_a_completed_run_start_a_new_list(tmp_path):
    for case, chash, force in (("other", "h2", False), ("force", "h1", True)):
        interrupted_attempt(tmp_path / case, "h1")
        run = RunFolder(tmp_path / case)
        run.start(chash, force=force)
        run.finish()
        assert [a["state"] for a in status(tmp_path / case)["attempts"]] == ["completed"], case
    run = RunFolder(tmp_path / "force")
    run.start("h1", force=True)   # over a completed run of the same config
    run.finish()
    assert len(status(tmp_path / "force")["attempts"]) == 1
