"""README.md runs as written.

`readme_commands` collects every command README.md shows: each line of a ```bash block (a
trailing `# comment` dropped, an `a && b` list split into its commands) and each inline-code
span of the prose that starts with `elasjax `, `python `, `python3 `, `PYTHONPATH=`, `pip ` or
a script `experiments/NAME.py` (a span broken over two lines joined by a space). `COVERAGE`
says how each one is covered, and `test_every_readme_command_is_covered` fails naming any
command README gains that `COVERAGE` does not name (and any entry README no longer has):

- **run**: run as written, in a subprocess, in a scratch directory holding a copy of
  `configs/`, so that what a command writes under `runs/` lands there (nothing else of the
  command is rewritten): the demo (`elasjax train configs/demo.yaml --out runs/demo`, its
  recoveries' plan changes as README prints them), its fault-free twin and `elasjax compare`
  (asserting the line README quotes: "identical sample ids per step: yes"), the launch with
  three SIGKILLs (`elasjax launch configs/multiprocess.yaml ...`: process 0 finishes alone, each
  recovery a standby hit, as README says), `python -c "import elasjax; help(elasjax)"`, and
  `python -m elasjax.observe.reference` (in a scratch copy of the package: it rewrites the
  docs/ beside the package it runs from, and this checkout's docs are left alone).
- **reduced**: the standby demo (`elasjax train configs/demo.yaml --standby`: both failures
  standby hits, as README says) with `--set train.steps=21` appended: the run ends at its
  second failure, so it skips only the pause that builds the standby of a plan no failure
  uses, half its time.
- **same run**: `elasjax train configs/demo.yaml` is the demo run above without `--out`.
- **elsewhere**: the three `python examples/*.py` are run as written by
  tests/test_api.py::test_examples_survive_failures_within_the_contract (checked here to name
  the same scripts), so the suite does not run them twice; the bitwise sweep's chains
  (`python -m elasjax.bench.bitwise --chain`) by tests/test_bitwise_sweep.py.
- **validated**: too slow for CI's 2 cores (the suite's budget is 20 minutes), so run up to the
  point where the work starts, by the command's own code (`dry_run.py` below): the 2,000-step
  standby run and the 200-step demo launch (the CLI's config loading, fault-schedule and
  `--kill` checks, initial plan: a config error such as "is outside the run" is still caught;
  `trainer.run` and the launch's processes are not started), the benchmark and experiment
  scripts (their argparse parses the arguments; for bench_scale.py also its loop and size
  names), and the demo_grow run (about 3 minutes).
- **synopsis**: the CLI table's forms with placeholders (CONFIG, P, RUN, ...): the CLI's parser
  accepts them with the placeholders filled in; **name**: a bare subcommand name, which the
  parser has.
- **ci**: the install and test commands are not re-run here: `.ci/run` runs each of them (checked
  to hold each one as a line); **install**: `pip install 'elasjax[tensorboard]'`, whose extra is
  checked to exist in pyproject.toml.

The runs use the suite's environment (conftest's XLA flags, `JAX_DISABLE_MOST_OPTIMIZATIONS=1`
as the suite's other CLI runs and launches use, the session's program store) and a TMPDIR of
their own; the text of each command is README's.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import deaths

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# inline-code spans of the prose that are commands
COMMAND_START = re.compile(r"(elasjax |python |python3 |PYTHONPATH=|pip |experiments/\S+\.py)")


def readme_commands(text: str) -> list[str]:
    """The commands of a README text, in order, each once (see the module docstring)."""
    found: list[str] = []
    prose: list[str] = []
    in_block, bash = False, False
    for line in text.splitlines():
        fence = re.match(r"\s*```\s*(\S*)", line)
        if fence:
            if in_block:
                in_block = False
            else:
                in_block, bash = True, fence.group(1) in ("bash", "sh", "shell", "console")
            prose.append("")
            continue
        if not in_block:
            prose.append(line)
        elif bash:
            # a trailing comment is README's note on the command, a line of `#` its expected output
            code = _drop_comment(line).strip()
            found += [c.strip() for c in code.split(" && ") if c.strip()] if code else []
    for m in re.finditer(r"`([^`]+)`", "\n".join(prose)):
        span = " ".join(m.group(1).split())
        if COMMAND_START.match(span):
            found.append(span)
    return list(dict.fromkeys(found))


def _drop_comment(line: str) -> str:
    """`line` without a `#` comment outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


# The launch of README's "Real process deaths" section: three SIGKILLs, each recovered from a
# standby built before step 0 and again after each recovery (`--standby`).
LAUNCH = ("elasjax launch configs/multiprocess.yaml --processes 4 --devices-per-process 2 "
          "--collective-timeout 1 --standby --set train.steps=12 --kill 3:1 --kill 6:2 --kill 9:3")
DEMO = "elasjax train configs/demo.yaml --out runs/demo"
DEMO_REF = "elasjax train configs/demo.yaml --set faults=[] --out runs/demo_ref"
COMPARE = "elasjax compare runs/demo runs/demo_ref"
STANDBY_DEMO = "elasjax train configs/demo.yaml --standby"
HELP = 'python -c "import elasjax; help(elasjax)"'
REFERENCE = "python -m elasjax.observe.reference"
EXAMPLES = ["python examples/mlp_pieces.py", "python examples/adafactor_mixed.py",
            "python examples/classifier_loop.py"]
# every README command -> (how it is covered, what covers it)
COVERAGE: dict[str, tuple[str, str]] = {
    "python3 -m venv .venv": ("ci", ".ci/run"),
    ". .venv/bin/activate": ("ci", ".ci/run"),
    "pip install -e .": ("ci", "the editable install .ci/run makes, with the test extra"),
    DEMO: ("run", "test_the_demo_and_its_comparison_run_as_written"),
    "pip install -q -e '.[test]'": ("ci", ".ci/run"),
    "pytest -q -n 2 --dist loadfile --no-loadscope-reorder": ("ci", ".ci/run"),
    DEMO_REF: ("run", "test_the_demo_and_its_comparison_run_as_written"),
    COMPARE: ("run", "test_the_demo_and_its_comparison_run_as_written"),
    LAUNCH: ("run", "test_the_launch_with_three_kills_runs_as_written"),
    **{e: ("elsewhere", "tests/test_api.py::test_examples_survive_failures_within_the_contract")
       for e in EXAMPLES},
    "elasjax train configs/demo.yaml --set train.steps=2000 --set 'faults=[{at_step: 800, "
    "devices: [3]}, {at_step: 1600, hosts: [0]}]'": ("validated", "2,000 steps: about 2 minutes"),
    "elasjax launch": ("name", "launch"),
    "elasjax launch configs/demo.yaml --processes 4 --devices-per-process 2 --set "
    "train.steps=200 --set 'faults=[]' --kill 120:3 --kill 160:2":
        ("validated", "a 200-step launch of 4 processes with the standby's compiles: minutes"),
    STANDBY_DEMO: ("reduced", "test_the_standby_demo_runs_as_written"),
    "experiments/bench_standby.py": ("validated", "python experiments/bench_standby.py"),
    "PYTHONPATH=. python experiments/bench_detection.py --wait-after-recovery":
        ("validated", "4 launches and 12 SIGKILLs, then skew and restart runs"),
    "PYTHONPATH=. python experiments/soak_kills.py --launches 10 --seed 83 --configs "
    "configs/demo_zero.yaml --steps 20 --kill-from 2 --set standby.wait_at_start=true --set "
    "standby.wait_after_recovery=true": ("validated", "10 launches of 4 processes: ~10 minutes"),
    "elasjax train CONFIG": ("synopsis", "train configs/demo.yaml"),
    "elasjax launch CONFIG --processes P": ("synopsis", "launch configs/demo.yaml --processes 4"),
    "elasjax launch CONFIG --cluster": ("synopsis", "launch configs/demo.yaml --cluster"),
    "elasjax launch SCRIPT.py --processes P [-- ARGS]": (
        "synopsis", "launch examples/own_loop.py --processes 4"),
    "elasjax launch SCRIPT.py": ("name", "launch"),
    "elasjax launch examples/own_loop.py --processes 4 --devices-per-process 2 --kill 6:1 -- "
    "--standby": ("elsewhere", "tests/test_own_loop_launch.py::"
                  "test_a_users_loop_survives_sigkills_of_any_process_with_the_fault_free_computation"),
    "PYTHONPATH=. python experiments/fuzz_own_loop.py --launches 10 --seed 81 --standby": (
        "validated", "10 launches of 4 processes: about 3 minutes"),
    "elasjax plan CONFIG --devices 8 --fail 3": (
        "synopsis", "plan configs/demo.yaml --devices 8 --fail 3"),
    "elasjax compare RUN REFERENCE": ("synopsis", "compare runs/demo runs/demo_ref"),
    "elasjax sim CONFIG": ("synopsis", "sim configs/sim/growth.yaml"),
    "pip install 'elasjax[tensorboard]'": ("install", "tensorboard"),
    "elasjax sim": ("name", "sim"),
    "elasjax train": ("name", "train"),
    "elasjax train|launch --import MODULE": (
        "synopsis", "train configs/demo.yaml --import user_hooks|"
                    "launch configs/demo.yaml --processes 4 --import user_hooks"),
    "elasjax train|launch --hook MODULE:FUNCTION": (
        "synopsis", "train configs/demo.yaml --hook user_hooks:count|"
                    "launch configs/demo.yaml --processes 4 --hook user_hooks:count"),
    HELP: ("run", "test_help_lists_the_public_names"),
    "python -m elasjax.bench.bitwise": (
        "elsewhere", "tests/test_bitwise_sweep.py (its rows' layouts, visited by the chains)"),
    "python -m elasjax.bench.bitwise --chain": (
        "elsewhere", "tests/test_bitwise_sweep.py runs its chains (the ZeRO demo's and the "
                     "pipeline demo's) as the module does"),
    'python experiments/bench_scale.py --sizes 3m,25m --modes "plain JAX ZeRO-1 undonated,'
    'elasjax deterministic ZeRO-1"': ("validated", "the 3.3M and 25.5M ladder, 3 rounds"),
    'python experiments/bench_scale.py --sizes 3m,25m --modes "plain JAX ZeRO-1 undonated,'
    'plain JAX ZeRO-1 undonated + ElasticState"': ("validated", "the 3.3M and 25.5M ladder"),
    "elasjax train configs/demo.yaml": ("same run", DEMO),
    "python experiments/bench_detection.py --wait-after-recovery": (
        "validated", "the PYTHONPATH=. form's benchmark"),
    "elasjax train configs/demo_grow.yaml": (
        "validated", "70 steps with a growth: about 3 minutes"),
    'python experiments/bench_scale.py --sizes demo,3m,25m --modes "plain JAX ZeRO-1 undonated,'
    'elasjax ZeRO-1"': ("validated", "a ladder up to 25.5M parameters, 3 rounds"),
    'python experiments/bench_scale.py --sizes 25m --rounds 1 --modes "elasjax ZeRO-1" --rss '
    '--rss-modes "elasjax ZeRO-1,elasjax ZeRO-1 no snapshots"': (
        "validated", "25.5M parameters, each loop's memory in a process of its own"),
    REFERENCE: ("run", "test_the_reference_pages_are_written_as_written"),
    "python -m elasjax.observe.reference [--check]": ("synopsis", "--check"),
    "elasjax train / plan / compare / sim / launch": ("name", "train plan compare sim launch"),
}

# README's fragments that complete a command given just before them, validated as the whole
# command: (the fragment as README writes it, the command it stands for)
FRAGMENTS = [
    ('`--sizes 100m --modes "plain JAX ZeRO-1 undonated,elasjax deterministic ZeRO-1"`',
     'python experiments/bench_scale.py --sizes 100m --modes "plain JAX ZeRO-1 undonated,'
     'elasjax deterministic ZeRO-1"'),
]


def _readme() -> str:
    return README.read_text()


# ---------------------------------------------------------------------------------------------
# the extraction


def test_the_extraction_reads_bash_blocks_and_inline_commands():
    text = "\n".join([
        "Run `elasjax train configs/a.yaml --set",
        "train.steps=3` here, not `--out DIR` nor `configs/a.yaml` nor `elasjax.run(cfg)`.",
        "```bash",
        "python3 -m venv .venv && . .venv/bin/activate && elasjax compare a b   # a note",
        "# expected output, not a command",
        "python x.py --m 'a # b'",
        "```",
        "```",
        "elasjax output line of a plain block",
        "```",
        "then `PYTHONPATH=. python experiments/bench_x.py --y` and `elasjax compare a b`.",
    ])
    assert readme_commands(text) == [
        "python3 -m venv .venv", ". .venv/bin/activate", "elasjax compare a b",
        "python x.py --m 'a # b'", "elasjax train configs/a.yaml --set train.steps=3",
        "PYTHONPATH=. python experiments/bench_x.py --y",
    ]


def test_every_readme_command_is_covered():
    found = readme_commands(_readme())
    uncovered = [c for c in found if c not in COVERAGE]
    stale = [c for c in COVERAGE if c not in found]
    assert not uncovered, f"README commands tests/test_readme.py does not cover: {uncovered}"
    assert not stale, f"tests/test_readme.py covers commands README no longer has: {stale}"
    kinds = {"run", "reduced", "same run", "elsewhere", "validated", "synopsis", "name", "ci",
             "install"}
    assert {k for k, _ in COVERAGE.values()} <= kinds
    for fragment, _ in FRAGMENTS:
        assert fragment in " ".join(_readme().split()), f"README no longer says {fragment!r}"


def test_the_ci_script_runs_the_install_and_test_commands():
    lines = {line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()}
    for cmd, (kind, _) in COVERAGE.items():
        # the demo's plain install is .ci/run's test install without its extra
        cmd = "pip install -q -e '.[test]'" if cmd == "pip install -e ." else cmd
        if kind == "ci":
            assert cmd in lines, f".ci/run does not run README's {cmd!r}"


def test_an_install_names_an_extra_the_package_has():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for cmd, (kind, extra) in COVERAGE.items():
        if kind == "install":
            assert f"elasjax[{extra}]" in cmd and extra in extras, cmd


def test_the_examples_are_the_ones_test_api_runs():
    # run there as written: `sys.executable examples/SCRIPT` in the repository root
    src = (ROOT / "tests" / "test_api.py").read_text()
    params = re.search(r'@pytest\.mark\.parametrize\("script, first", \[(.*?)\]\)\s*'
                       r"def test_examples_survive_failures_within_the_contract\(", src, re.S)
    assert params, "tests/test_api.py no longer runs the examples"
    assert re.findall(r'\("(\w+\.py)"', params.group(1)) == [e.split("/")[-1] for e in EXAMPLES]


def test_the_cli_synopses_and_names_parse(tmp_path, capsys):
    from elasjax import cli
    from elasjax.observe import reference

    for cmd, (kind, how) in COVERAGE.items():
        if kind == "name":
            for name in how.split():  # `--help` of a subcommand the parser has exits 0
                with pytest.raises(SystemExit) as e:
                    cli.parser().parse_args([name, "--help"])
                assert e.value.code == 0, cmd
        elif kind == "synopsis" and cmd.startswith("elasjax "):
            for filled in how.split("|"):  # a flag the parser lacks exits 2
                cli.parser().parse_args(shlex.split(filled))
    # `--check` against an empty directory: both pages stale, nothing written
    assert reference.main(["--check", "--docs", str(tmp_path)]) == 1
    assert not list(tmp_path.iterdir())
    capsys.readouterr()


# ---------------------------------------------------------------------------------------------
# running them


def _scratch(tmp_path: Path) -> tuple[Path, dict]:
    """A directory to run README's commands in (its `configs/` a copy of this checkout's,
    `examples/` and `experiments/` links to them; what they write under `runs/` lands in it),
    and their environment: the suite's, a TMPDIR of their own (a launch without `--out` writes
    under it), the venv's commands first on PATH."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copytree(ROOT / "configs", work / "configs")
    for scripts in ("examples", "experiments"):  # run from here, never written to
        (work / scripts).symlink_to(ROOT / scripts)
    (work / "tmp").mkdir()
    env = {**os.environ, "TMPDIR": str(work / "tmp"), "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return work, env


def _run(cmd: str, cwd: Path, env: dict, timeout: int = 600) -> str:
    """`cmd` as a shell runs it; its output, after asserting exit code 0. On a timeout every
    process it started is killed (its own session)."""
    p = subprocess.Popen(["bash", "-c", cmd], cwd=cwd, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"{cmd!r} did not end within {timeout}s:\n{out[-4000:]}")
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 0, f"{cmd!r} ended with exit code {p.returncode}:\n{out[-4000:]}"
    return out


@pytest.mark.slow
def test_the_demo_and_its_comparison_run_as_written(tmp_path):
    work, env = _scratch(tmp_path)
    out = _run(DEMO, work, env)
    # README's printout: the device, then the host
    assert "d4t2m2b4 => d7t1m2b3" in _recovery_line(out, "step 10: devices [3] failed")
    assert "d7t1m2b3 => d5t1m2b4" in _recovery_line(out, "step 20: hosts [0] failed")
    assert (work / "runs" / "demo" / "metrics.jsonl").exists()
    _run(DEMO_REF, work, env)
    out = _run(COMPARE, work, env)
    # README quotes this line of the comparison, and a deviation of ~1e-7 over the 40 steps
    # (the contract: 1e-5, ARCHITECTURE.md rule 3)
    assert "identical sample ids per step: yes" in out, out
    dev = re.search(r"train loss, all steps\s+steps\s+40\s+max rel dev (\S+)", out)
    assert dev and float(dev.group(1)) <= 1e-5, out
    # every recovery compared every leaf, and the demo learns (the first loss minus the last)
    events = [json.loads(x) for x in (work / "runs" / "demo" / "events.jsonl").open()]
    recs = [e for e in events if e["type"] == "recovery"]
    assert len(recs) == 2 and all(
        e["verify"]["leaves"] > 0 and e["verify"]["digest_before"] == e["verify"]["digest_after"]
        for e in recs), recs
    losses = [json.loads(x)["loss"] for x in (work / "runs" / "demo" / "metrics.jsonl").open()]
    assert len(losses) == 40 and losses[-1] < losses[0] - 1.0, losses


def _recovery_line(out: str, head: str) -> str:
    """The printed recovery line that starts with `head`, whitespace joined (the console wraps
    its lines where no terminal gives it a width)."""
    text = " ".join(out.split())
    assert head in text, out[-4000:]
    return head + text.split(head, 1)[1].split("verified", 1)[0]


@pytest.mark.slow
def test_the_standby_demo_runs_as_written(tmp_path):
    # at 21 steps, through the second failure (step 20): the 19 steps after it add only the
    # pause that builds the last plan's standby, which no failure of this run uses
    work, env = _scratch(tmp_path)
    out = _run(f"{STANDBY_DEMO} --set train.steps=21", work, env)
    # README: "Both failures are then standby hits"
    for head in ("step 10: devices [3] failed", "step 20: hosts [0] failed"):
        assert "standby hit" in _recovery_line(out, head), out[-4000:]


@pytest.mark.slow
def test_the_launch_with_three_kills_runs_as_written(tmp_path):
    work, env = _scratch(tmp_path)
    out = _run(LAUNCH, work, env)
    assert "elasjax launch: finished" in out, out[-4000:]
    # README: process 0 finishes alone, each of the three recoveries a standby hit
    assert "per process: p0=0, p1=SIGKILL, p2=SIGKILL, p3=SIGKILL" in out, out[-4000:]
    for step, proc in ((3, 1), (6, 2), (9, 3)):
        line = next((x for x in out.splitlines()
                     if x.startswith(f"recovery at step {step}: process {proc} killed")), None)
        assert line is not None and "standby hit True" in line, (step, proc, out[-4000:])
    # a hit on a renewed CPU client compiles nothing (the compile counter, not a time: the
    # executables are reloaded onto the new client); before the eval key moved into its trace
    # (step.make_eval_step) the reload compiled two small programs (experiments/RESULTS.md,
    # "a standby hit under launch compiles twice")
    (events,) = (work / "tmp").glob("elasjax-launch-*/events.jsonl")
    recs = deaths([json.loads(x) for x in events.open()])  # (a collective retry is no death)
    assert [(e["step"], e["standby_hit"], e["compiles"]) for e in recs] == [
        (3, True, 0), (6, True, 0), (9, True, 0)], recs


def test_help_lists_the_public_names(tmp_path):
    work, env = _scratch(tmp_path)
    out = _run(HELP, work, env, timeout=300)
    assert "ElasticState" in out and "plan_mesh" in out


def test_the_reference_pages_are_written_as_written(tmp_path):
    # in a copy of the package: the command writes docs/ beside the package it runs from
    # (`elasjax.observe.reference.DOCS`), and `python -m` finds the copy first (the current
    # directory leads sys.path)
    work, env = _scratch(tmp_path)
    shutil.copytree(ROOT / "elasjax", work / "elasjax",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (work / "docs").mkdir()
    out = _run(REFERENCE, work, env, timeout=300)
    for name in ("config-reference.md", "events-reference.md"):
        assert f"wrote {work / 'docs' / name}" in out, out
        assert (work / "docs" / name).read_text() == (ROOT / "docs" / name).read_text(), (
            f"docs/{name} differs from what the code writes (tests/test_reference.py says which)")


# A dry run: the command's own code up to where its work would start. For `elasjax train` and
# `elasjax launch`, the CLI as written (config loaded and checked, fault schedule and --kill
# resolved against the run, the launch's initial plan) with `trainer.run` and the launch's
# attempts replaced by an exit; for a script, its argparse parsing of the arguments (and
# bench_scale.py's loop and size names), then an exit.
DRY_RUN = r'''
import argparse, os, runpy, sys

def stop(*a, **k):
    print("dry run: validated")
    raise SystemExit(0)

argv = sys.argv[1:]
if argv[0] == "elasjax":
    from elasjax import cli
    import elasjax.launch.local as local
    import elasjax.loop.trainer as trainer
    trainer.run = stop
    local._attempts = stop
    sys.exit(cli.main(argv[1:]))

parse = argparse.ArgumentParser.parse_args

def parse_then_stop(self, args=None, namespace=None):
    ns = parse(self, args, namespace)
    g = sys.modules["__main__"].__dict__
    if "mode_names" in g and "SIZES" in g:  # bench_scale.py
        for names in (ns.modes, ns.rss_modes):
            g["mode_names"](names)
        unknown = [s for s in ns.sizes.split(",") if s not in g["SIZES"] and ":" not in s]
        if unknown:
            raise SystemExit(f"unknown sizes {unknown}; allowed: {list(g['SIZES'])}")
    stop()

argparse.ArgumentParser.parse_args = parse_then_stop
script = argv[0]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
sys.argv = argv
runpy.run_path(script, run_name="__main__")
'''

VALIDATED = [c for c, (kind, _) in COVERAGE.items() if kind == "validated"] + [
    c for _, c in FRAGMENTS]


def _dry(cmd: str, dry: Path) -> str:
    """`cmd` with its program replaced by the dry run: `elasjax ARGS` -> `python DRY elasjax
    ARGS`, `[ENV=...] python SCRIPT ARGS` -> `[ENV=...] python DRY SCRIPT ARGS`, and a bare
    `experiments/SCRIPT ARGS` -> `python DRY experiments/SCRIPT ARGS`; the arguments as
    written."""
    if cmd.startswith(("elasjax ", "experiments/")):
        return f"python {dry} {cmd}"
    head, sep, rest = cmd.partition("python ")
    assert sep and rest.startswith("experiments/"), cmd
    return f"{head}python {dry} {rest}"


@pytest.mark.parametrize("cmd", VALIDATED,
                         ids=[re.sub(r"[^\w.=,:/-]+", "_", c) for c in VALIDATED])
def test_a_slow_command_is_valid_as_written(cmd, tmp_path):
    work, env = _scratch(tmp_path)
    dry = tmp_path / "dry_run.py"
    dry.write_text(DRY_RUN)
    out = _run(_dry(cmd, dry), work, env, timeout=300)
    assert "dry run: validated" in out, out[-3000:]


def test_a_dry_run_refuses_what_the_run_would_refuse(tmp_path):
    # README's launch once killed at step 9 of the config's 8 steps (issue 80): the run ended
    # at once with this error, and the dry run must end the same way
    work, env = _scratch(tmp_path)
    dry = tmp_path / "dry_run.py"
    dry.write_text(DRY_RUN)
    cmd = LAUNCH.replace(" --set train.steps=12", "")
    p = subprocess.run(["bash", "-c", _dry(cmd, dry)], cwd=work, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2 and "dry run: validated" not in p.stdout, p.stdout + p.stderr
    assert "config 'faults[2].at_step' = 9 is outside the run" in p.stderr, p.stderr
