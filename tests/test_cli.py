"""The `elasjax` command line: train, plan, compare (the README's demo runs as written in
tests/test_readme.py)."""

import pytest
from conftest import TINY

from elasjax import cli
from elasjax.observe.compare import compare_runs


def test_plan_command(capsys):
    assert cli.main(["plan", "configs/demo.yaml", "--devices", "8", "--fail", "3"]) == 0
    out = capsys.readouterr().out
    assert "initial plan on 8 devices: d4t2m2b4" in out
    assert "after failing [3] (7 live): d7t1m2b3" in out


def test_plan_command_rejects_unknown_device(capsys):
    assert cli.main(["plan", "configs/demo.yaml", "--devices", "8", "--fail", "11"]) == 2
    assert "--fail names devices [11]; allowed values: 0 .. 7" in capsys.readouterr().err


def test_train_rejects_unknown_key(capsys):
    assert cli.main(["train", "configs/demo.yaml", "--set", "train.lrr=1"]) == 2
    assert "unknown config key 'train.lrr'" in capsys.readouterr().err


def test_compare_rejects_non_run_dir(tmp_path, capsys):
    assert cli.main(["compare", str(tmp_path), str(tmp_path)]) == 2
    assert "metrics.jsonl not found" in capsys.readouterr().err


@pytest.mark.slow
def test_train_and_compare_commands(tmp_path, capsys):
    sets = [a for kv in TINY for a in ("--set", kv)] + ["--set", "train.steps=6"]
    fault = ["--set", "faults=[{at_step: 3, hosts: [1]}]"]
    assert cli.main(["train", "configs/demo.yaml", *sets, *fault, "--out", str(tmp_path / "a"),
                     "--hook", "user_hooks:count"]) == 0
    # the user's hook (tests/user_hooks.py) saw every step once and the one recovery
    from user_hooks import COUNTS

    assert COUNTS["steps"] == list(range(6)) and COUNTS["recoveries"] == 1
    assert COUNTS["events"][0] == "start" and COUNTS["events"][-1] == "end"
    out = capsys.readouterr().out
    assert "Recoveries" in out and "MTTR breakdown" in out and "hosts [1]" in out
    assert cli.main(["train", "configs/demo.yaml", *sets, "--set", "faults=[]", "--quiet",
                     "--out", str(tmp_path / "b")]) == 0
    capsys.readouterr()
    assert cli.main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "identical sample ids per step: yes" in out and "post-failure" in out
    r = compare_runs(tmp_path / "a", tmp_path / "b")
    assert r["all"]["steps"] == 6 and r["all"]["max_rel"] <= 1e-5


def test_import_finds_a_module_in_the_current_directory(tmp_path, monkeypatch):
    """`--import MODULE` (and `--hook`) look in the current directory first, as `python -m`
    does; the `elasjax` command's own directory is what Python put on `sys.path`."""
    import sys

    from elasjax.config import ConfigError
    from elasjax.launch.process import import_modules

    (tmp_path / "my_cwd_model.py").write_text("LOADED = True\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_cwd_model", raising=False)
    import_modules(["my_cwd_model"])
    assert sys.modules["my_cwd_model"].LOADED
    with pytest.raises(ConfigError, match=r"--import no_such_module_here: .*looked in the current "
                                          r"directory .*set PYTHONPATH"):
        import_modules(["no_such_module_here"])

