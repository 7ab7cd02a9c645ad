"""docs/config-reference.md and docs/events-reference.md are what
`python -m elasjax.observe.reference` writes from the dataclasses: a field added, removed or
re-commented without rewriting them fails here."""

from elasjax import config
from elasjax.observe import reference


def test_the_generated_references_are_the_codes():
    assert reference.main(["--check"]) == 0, (
        "run `python -m elasjax.observe.reference` and commit docs/")


def test_every_config_key_and_event_type_is_in_the_references():
    text = reference.config_reference()
    for section in ("model", "train", "parallel", "snapshot", "recovery", "standby", "faults"):
        assert f"## `{section}`" in text
    assert "| `deterministic` | " in text and "| `resume_step` | " in text
    assert config.TrainConfig.__doc__.split()[0] in text
    events = reference.events_reference()
    for kind in ("start", "recovery", "join", "migration", "growth", "standby_ready",
                 "failure_cost", "warning", "end", "error", "cutover_abandoned"):
        assert f"## `{kind}` (" in events, kind
    assert "| `mttr_s` | " in events and "| `final_loss` | " in events
