"""The events and metrics files when the process writing them dies (`metrics.JsonlWriter`):
the next writer appends what the file lacks, each record once, whatever the dead writer had
written of its own (`events.LOCAL_TYPES`)."""

import json

from elasjax.observe.events import LOCAL_TYPES
from elasjax.observe.metrics import JsonlWriter, read_jsonl


class Writing:
    """Which process writes the file now (the runtime's `writer`)."""

    def __init__(self, me: int):
        self.me, self.writer = me, 0

    def __call__(self) -> bool:
        return self.me == self.writer


def _pair(path):
    w0, w1 = Writing(0), Writing(1)
    return (w0, JsonlWriter(path, w0, LOCAL_TYPES)), (w1, JsonlWriter(path, w1, LOCAL_TYPES))


def test_the_next_writer_appends_what_the_dead_one_had_not_written(tmp_path):
    path = tmp_path / "events.jsonl"
    (_, a), (w1, b) = _pair(path)
    for rec in ({"type": "start", "step": 0}, {"type": "step", "step": 0}):
        a.write(rec)
        b.write(rec)
    b.write({"type": "step", "step": 1})  # process 0 died before it wrote this one
    with path.open("a") as f:
        f.write('{"type": "st')  # ... in the middle of a line
    w1.writer = 1
    b.write({"type": "recovery", "step": 2})
    assert [r["type"] for r in read_jsonl(path)] == ["start", "step", "step", "recovery"]


def test_a_record_one_process_alone_emits_does_not_cost_the_next_writer_a_record(tmp_path):
    """The dead writer saw its standby built at step 3, its successor had not yet: the
    successor's recovery event is still written, and its own standby_ready when it has one. In
    a count of every line, the dead writer's standby_ready stood in for the recovery (the CI run
    of stop 58: test_killing_process_0_is_survived_like_any_other_death found no recovery)."""
    path = tmp_path / "events.jsonl"
    (_, a), (w1, b) = _pair(path)
    for w in (a, b):
        w.write({"type": "start", "step": 0})
    a.write({"type": "standby_ready", "step": 3, "process": 0})
    w1.writer = 1  # process 0 died in step 4
    b.write({"type": "recovery", "step": 4})
    b.write({"type": "standby_ready", "step": 9, "process": 1})
    b.write({"type": "end", "step": 12})
    got = [(r["type"], r.get("process")) for r in read_jsonl(path)]
    assert got == [("start", None), ("standby_ready", 0), ("recovery", None),
                   ("standby_ready", 1), ("end", None)]
    assert b.lines == 3  # what a rejoining process continues at: the records every process emits


def test_a_record_of_its_own_is_written_only_by_the_writer(tmp_path):
    path = tmp_path / "events.jsonl"
    (_, a), (_, b) = _pair(path)
    a.write({"type": "start", "step": 0})
    b.write({"type": "start", "step": 0})
    b.write({"type": "standby_ready", "step": 2, "process": 1})
    a.write({"type": "standby_ready", "step": 3, "process": 0})
    lines = path.read_text().splitlines()
    assert [json.loads(ln).get("process") for ln in lines] == [None, 0]


def test_an_error_of_the_writer_alone_does_not_cost_its_successor_a_record(tmp_path):
    """A hook raised in process 0 alone: it wrote its error and stopped; process 1 takes over
    with the recovery from that death."""
    path = tmp_path / "events.jsonl"
    (_, a), (w1, b) = _pair(path)
    for w in (a, b):
        w.write({"type": "start", "step": 0})
    a.write({"type": "error", "error": "ValueError", "message": "from a hook", "process": 0})
    w1.writer = 1
    b.write({"type": "recovery", "step": 5})
    assert [r["type"] for r in read_jsonl(path)] == ["start", "error", "recovery"]


def test_a_writer_declared_dead_writes_nothing_when_it_resumes(tmp_path):
    """Process 0 writes the file, is stopped (SIGSTOP) and declared dead; process 1 takes the
    file over and goes on. When process 0 resumes, its error record (it finds itself fenced)
    and anything else it emits stay out of the file: from its old position it wrote over
    process 1's lines (a broken events file in experiments/RESULTS.md, "The MTTR fuzz")."""
    path = tmp_path / "events.jsonl"
    (w0, a), (w1, b) = _pair(path)
    for rec in ({"type": "start", "step": 0}, {"type": "step", "step": 0}):
        a.write(rec)
        b.write(rec)
    w0.writer = w1.writer = 1  # process 0 declared dead: the runtime says it no longer writes
    for rec in ({"type": "recovery", "step": 1}, {"type": "failure_cost", "step": 1}):
        b.write(rec)
    a.write({"type": "error", "error": "DeclaredDeadError", "message": "fenced", "process": 0})
    a.write({"type": "step", "step": 1})
    a.close()
    b.close()
    assert [r["type"] for r in read_jsonl(path)] == ["start", "step", "recovery",
                                                     "failure_cost"]
