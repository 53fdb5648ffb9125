"""The goodput ledger: every second of wall time charged to one bucket, lost work after a
restart, and `slipstream goodput`."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from train_fixtures import small_config

from slipstream.cli import main
from slipstream.perf.goodput import BUCKETS, format_summary, read_events, summarize
from slipstream.train.trainer import Trainer

pytest_plugins = ["train_fixtures"]


def _crash_and_restart_events(finished: bool = True) -> list[dict]:
    """A launcher, an attempt that commits step 2 and dies after step 3, and a restarted attempt
    that restores step 2 and redoes step 3. The charged durations leave 0.7 s to `other`, so a
    test can tell it shrinking from its being clamped at 0."""
    events = [
        {"event": "launch", "t": 100.0},
        {"event": "start", "t": 103.0, "process_start": 101.0},
        {"event": "ready", "t": 103.0, "process_start": 101.0, "restore_s": 0.0, "backoff_s": 0.0},
        {"event": "step", "t": 104.0, "step": 1, "step_s": 1.0, "data_s": 0.1},
        {"event": "step", "t": 105.0, "step": 2, "step_s": 1.0, "data_s": 0.1},
        {"event": "checkpoint", "t": 105.2, "step": 2, "stall_s": 0.2},
        {"event": "commit", "t": 105.5, "step": 2},
        {"event": "eval", "t": 106.0, "step": 2, "eval_s": 0.5},
        {"event": "profile", "t": 106.3, "step": 2, "trace_s": 0.1},
        {"event": "step", "t": 107.0, "step": 3, "step_s": 1.0, "data_s": 0.0},
        {"event": "start", "t": 113.0, "process_start": 110.0},
        {"event": "ready", "t": 113.0, "process_start": 110.0, "restore_s": 1.0, "backoff_s": 0.5},
        {"event": "step", "t": 114.0, "step": 3, "step_s": 1.0, "data_s": 0.0},
    ]
    if finished:
        events.append({"event": "end", "t": 114.5, "reason": "finished", "step": 3})
    return events


def test_buckets_sum_to_wall_time_and_charge_lost_work():
    """Launch to last event is 14.5 s: the first step 3 (lost in the crash) is lost work, the
    gap from its last event to the next process plus the backoff is restart downtime, the
    restarted process's start-up less its restore is start-up, the trace's writing is profiling,
    and the 0.7 s no event accounts for is `other`; the buckets sum to the total."""
    summary = summarize(_crash_and_restart_events())
    seconds = summary["seconds"]
    expected = {"productive": 0.9 + 0.9 + 1.0, "data_stall": 0.2, "startup": 1.0 + 2.0 + 1.5,
                "restore": 1.0, "checkpoint_stall": 0.2, "eval": 0.5, "profiling": 0.1, "lost_work": 1.0,
                "restart": 3.0 + 0.5, "other": 0.7}
    assert set(seconds) == set(BUCKETS)
    for bucket, value in expected.items():
        assert seconds[bucket] == pytest.approx(value), bucket
    assert summary["total_s"] == pytest.approx(14.5) == pytest.approx(sum(seconds.values()))
    assert summary["goodput"] == pytest.approx(2.8 / 14.5)
    counts = (summary["attempts"], summary["restarts"], summary["steps_kept"], summary["steps_lost"])
    assert counts == (2, 1, 3, 1)
    assert summary["finished"]


def test_a_finished_run_started_again_leaves_the_time_between_the_jobs_out():
    """A finished run launched again (to train further) an hour later: the hour is no attempt's
    time, neither restart downtime nor part of the total; the new launch's start-up is start-up."""
    first = _crash_and_restart_events()
    again = [
        {"event": "launch", "t": 3714.5},
        {"event": "start", "t": 3717.0, "process_start": 3715.5},
        {"event": "ready", "t": 3717.0, "process_start": 3715.5, "restore_s": 1.0, "backoff_s": 0.0},
        {"event": "step", "t": 3718.0, "step": 4, "step_s": 1.0, "data_s": 0.0},
        {"event": "end", "t": 3718.5, "reason": "finished", "step": 4},
    ]
    alone, summary = summarize(first), summarize(first + again)
    assert summary["between_jobs_s"] == pytest.approx(3600.0)
    assert summary["total_s"] == pytest.approx(alone["total_s"] + 4.0)
    assert summary["seconds"]["restart"] == pytest.approx(alone["seconds"]["restart"])
    assert summary["seconds"]["startup"] == pytest.approx(alone["seconds"]["startup"] + 1.0 + 0.5)
    assert summary["seconds"]["productive"] == pytest.approx(alone["seconds"]["productive"] + 1.0)
    assert (summary["attempts"], summary["restarts"]) == (3, 1)
    assert sum(summary["seconds"].values()) == pytest.approx(summary["total_s"])
    assert "3600.0s between jobs" in format_summary(summary)


def test_unfinished_run_counts_steps_after_the_last_commit_as_lost():
    """While a run is not finished, steps after its newest committed checkpoint are at risk:
    they count as lost work until a checkpoint covers them."""
    summary = summarize(_crash_and_restart_events(finished=False))
    assert not summary["finished"] and summary["steps_lost"] == 2
    assert summary["seconds"]["lost_work"] == pytest.approx(2.0)
    assert sum(summary["seconds"].values()) == pytest.approx(summary["total_s"])


def test_goodput_command(data_dir, train_model_dir, tmp_path, capsys):
    """`slipstream goodput RUN_DIR` prints the breakdown of a real run, `--json` the same as a
    record whose buckets sum to the wall time; a directory without a ledger is an error."""
    torch.set_num_threads(1)
    run_dir = tmp_path / "run"
    Trainer(small_config(data_dir, train_model_dir, run_dir, "--training.steps=4", "--checkpoint.interval=2",
                         "--eval.interval=2")).run()
    assert main(["goodput", str(run_dir)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("goodput ") and "productive" in text and "checkpoint_stall" in text
    assert main(["goodput", str(run_dir), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["finished"] and summary["steps_kept"] == 4 and summary["restarts"] == 0
    assert summary["seconds"]["eval"] > 0 and summary["seconds"]["checkpoint_stall"] > 0
    assert sum(summary["seconds"].values()) == pytest.approx(summary["total_s"])
    assert 0 < summary["goodput"] < 1 and summary["seconds"]["other"] >= -1e-6
    assert main(["goodput", str(tmp_path)]) == 2


def test_events_after_the_last_attempts_end_do_not_change_the_summary():
    """A `launch` appended after a finished run's `end` (a relaunch that failed to start) or an
    unknown event leaves it finished, its steps kept and its wall time at 14.5 s: finished comes
    from the last attempt's last `end`, the total from the attempts' events."""
    clean = summarize(_crash_and_restart_events())
    for extra in ({"event": "launch", "t": 200.0}, {"event": "note", "t": 114.6}):
        summary = summarize([*_crash_and_restart_events(), extra])
        assert summary["finished"] and summary["steps_lost"] == 1 and summary["steps_kept"] == 3
        total = 14.6 if extra["event"] == "note" else 14.5  # an attempt's event extends it
        assert summary["total_s"] == pytest.approx(total)
        assert summary["seconds"]["productive"] == pytest.approx(clean["seconds"]["productive"])


def test_a_clock_stepping_back_gives_no_negative_wall_time():
    """The `end` written after the clock stepped back 54.5 s: the total runs from the launch
    (100) to the latest event (the last step, 114), 14.0 s, `other` shrinks by the 0.5 s cut off
    from 0.7 to 0.2 s (not clamped: nothing is overcharged), and the run is still finished (the
    order of events is the file's)."""
    events = _crash_and_restart_events()
    events[-1] = events[-1] | {"t": 60.0}
    summary = summarize(events)
    assert summary["total_s"] == pytest.approx(14.0) and summary["finished"]
    assert summary["seconds"]["other"] == pytest.approx(0.2)
    assert summary["overcharged_s"] == pytest.approx(0.0, abs=1e-9)
    assert summary["goodput"] == pytest.approx(2.8 / 14.0)
    assert sum(summary["seconds"].values()) == pytest.approx(14.0)


def test_durations_beyond_the_span_of_the_times_stretch_the_total():
    """Steps whose durations add up to more than the span of the ledger's times (overlapping
    events, a wall clock that stepped back under them) count whole: goodput stays a fraction,
    `other` is 0 rather than negative, and `overcharged_s` says by how much."""
    events = [{"event": "start", "t": 100.0, "process_start": 100.0},
              {"event": "ready", "t": 101.0, "process_start": 100.0, "restore_s": 0.0, "backoff_s": 0.0},
              *({"event": "step", "t": 102.0 + i, "step": i + 1, "step_s": 100.0, "data_s": 0.0}
                for i in range(2)),
              {"event": "commit", "t": 103.5, "step": 2}, {"event": "end", "t": 104.0, "finished": True}]
    summary = summarize(events)
    assert summary["goodput"] <= 1.0 and summary["seconds"]["other"] == 0.0
    assert summary["total_s"] == pytest.approx(sum(summary["seconds"].values()))
    assert 190 < summary["overcharged_s"] < summary["total_s"] - 3
    assert "exceed the span of their times by" in format_summary(summary)


MALFORMED_LINES = ["42", "null", '"step"', "[1]", '{"t": 1.0}', '{"event": "step", "t": "105"}',
                   '{"event": "step", "t": NaN, "step": 9, "step_s": 1.0, "data_s": 0.0}',
                   '{"event": "step", "t": 106.5, "step": 9, "step_s": 1.0}',
                   '{"event": "ready", "t": 103.0, "process_start": 101.0}',
                   '{"event": "start", "t": 103.0}', '{"event": "end", "t": 115.0}',
                   '{"event": "commit", "t": 106.0, "step": "3"}', '{"event": "step", "t": 10']


def test_malformed_ledger_lines_are_skipped_and_counted(tmp_path, capsys):
    """Lines that are valid JSON but not events (`42`, `null`), events without the fields their
    kind needs, a string or NaN `t`, and a line cut short are skipped, counted in
    `skipped_lines` and reported; the summary is the clean ledger's."""
    clean = summarize(_crash_and_restart_events())
    lines = [json.dumps(e) for e in _crash_and_restart_events()]
    lines[6:6] = MALFORMED_LINES  # after step 2's commit, before step 3
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "goodput.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["goodput", str(run_dir), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["skipped_lines"] == len(MALFORMED_LINES)
    assert summary["seconds"] == pytest.approx(clean["seconds"])
    counts = ("attempts", "restarts", "rollbacks", "steps_kept", "steps_lost", "last_step", "finished")
    assert {k: summary[k] for k in counts} == {k: clean[k] for k in counts}
    assert summary["total_s"] == pytest.approx(14.5) and summary["finished"]
    assert main(["goodput", str(run_dir)]) == 0
    assert f"; {len(MALFORMED_LINES)} malformed ledger line(s) skipped" in capsys.readouterr().out
    in_memory = summarize([*_crash_and_restart_events(), 42, None, {"event": "step", "t": "x"}])
    assert in_memory["skipped_lines"] == 3 and in_memory["seconds"] == pytest.approx(clean["seconds"])


def test_a_ledger_of_only_malformed_lines_reports_no_attempt(tmp_path, capsys):
    """A ledger with no well-formed `start` says no attempt started, not a KeyError."""
    (tmp_path / "goodput.jsonl").write_text("\n".join(MALFORMED_LINES) + "\n")
    assert main(["goodput", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"attempts": 0, "launches": 0, "finished": False}


def test_the_launch_counts_from_the_launchers_own_start(tmp_path):
    """The launcher's `launch` event is dated at its process's start, so that its own start-up
    (importing torch, checking the job: 1.5 s of a 6.8 s run) is charged; it was dated when
    recorded, after that start-up."""
    code = ("import sys, time; time.sleep(1.0); from slipstream.train.goodput import record_launch; "
            "record_launch(sys.argv[1])")
    before = time.time()
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=60)
    [launch] = read_events(tmp_path)
    assert launch["event"] == "launch" and before - 0.1 <= launch["t"] < before + 0.9
