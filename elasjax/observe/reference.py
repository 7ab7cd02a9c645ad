"""The config and event references, written from the dataclasses that define them.

    python -m elasjax.observe.reference          # rewrites docs/{config,events}-reference.md
    python -m elasjax.observe.reference --check  # exit 1 if either differs from the code

Each config section is its dataclass in `config/sections.py` (`Config`'s fields, in order): the class's
docstring, then each key with its type, its default and the comment written beside or above it
in the source. Each event is a typed record (`events.Record` and `metrics.RecoveryEvent`): its
`type`, its docstring and its fields as `events.jsonl` writes them. The tables are the code's
own words; `tests/test_reference.py` fails when a field changes and the files were not rewritten.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import sys
import textwrap
import tokenize
import typing
from pathlib import Path

from .. import config as config_module
from . import events, metrics

DOCS = Path(__file__).resolve().parents[2] / "docs"
HEADER = ("<!-- Written by `python -m elasjax.observe.reference` from the dataclasses; edit the "
          "code, not this file. -->\n\n")


def _comments(cls: type) -> dict[str, str]:
    """{field: its comment} from `cls`'s own source: the comment at the end of the field's
    line(s), else the comment lines right above it."""
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    by_line: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            by_line[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = src.splitlines()
    out: dict[str, str] = {}
    for node in ast.parse(src).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        trailing = [by_line[n] for n in range(node.lineno, node.end_lineno + 1) if n in by_line
                    and not lines[n - 1].lstrip().startswith("#")]
        above, n = [], node.lineno - 1
        while n >= 1 and lines[n - 1].lstrip().startswith("#"):
            above.insert(0, by_line.get(n, ""))
            n -= 1
        text = " ".join(trailing) or " ".join(above)
        if text:
            out[node.target.id] = text
    return out


def _all_comments(cls: type) -> dict[str, str]:
    out: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            out.update(_comments(base))
    return out


def _type(f: dataclasses.Field) -> str:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return t.replace("typing.", "").replace("Optional[", "optional[")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        v = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        v = f.default_factory()  # type: ignore[misc]
    else:
        return "(required)"
    if dataclasses.is_dataclass(v):
        return "(section)"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (tuple, list)) and not v:
        return "[]"
    if v == "":
        return '`""`'
    return f"`{v!r}`" if not isinstance(v, str) else f"`{v}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _doc(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    return "\n".join(textwrap.fill(p, 99) for p in doc.split("\n\n") if p.strip()).strip()


def _paragraphs(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    return "\n\n".join(" ".join(p.split()) for p in doc.split("\n\n") if p.strip())


def config_reference() -> str:
    out = [HEADER, "# Config reference\n\n",
           "Every key of a run's YAML, by section (`elasjax/config/sections.py`). Override any with "
           "`--set section.key=value`; an unknown key or a value outside the allowed ones is an "
           "error naming it. How the configs are used: [reference.md](reference.md#configs).\n"]
    for top in dataclasses.fields(config_module.Config):
        hint = typing.get_type_hints(config_module.Config)[top.name]
        cls = typing.get_args(hint)[0] if typing.get_origin(hint) is tuple else hint
        out.append(f"\n## `{top.name}`" + (" (a list of entries)" if cls is not hint else "") + "\n\n")
        out.append(_paragraphs(cls) + "\n\n")
        notes = _all_comments(cls)
        out.append("| key | type | default | note |\n|---|---|---|---|\n")
        for f in dataclasses.fields(cls):
            out.append(f"| `{f.name}` | `{_cell(_type(f))}` | {_cell(_default(f))} | "
                       f"{_cell(notes.get(f.name, ''))} |\n")
    return "".join(out)


def _records() -> list[tuple[str, type]]:
    """(the `type` written, the record class) for every event record."""
    classes = [c for c in vars(events).values() if isinstance(c, type)
               and issubclass(c, events.Record) and c is not events.Record]
    classes.append(metrics.RecoveryEvent)
    out = []
    for c in classes:
        if c is events.CutoverEvent:  # written as its kind
            out += [("migration", c), ("growth", c)]
        else:
            out.append((c.type, c))
    return sorted(out, key=lambda tc: tc[0])


def events_reference() -> str:
    out = [HEADER, "# Event reference\n\n",
           "Every record of `events.jsonl`, by its `type` (the typed records of "
           "`elasjax/observe/events.py` and `elasjax/observe/metrics.py`; a hook gets each as an "
           "`Event` whose `record` is the class named here). Fields marked *omitted when null* are left out of "
           "the line when they have no value. What the events mean: "
           "[reference.md](reference.md#output-files---out-dir).\n"]
    for kind, cls in _records():
        out.append(f"\n## `{kind}` ({cls.__name__})\n\n{_paragraphs(cls)}\n\n")
        notes = _all_comments(cls)
        out.append("| field | type | note |\n|---|---|---|\n")
        for f in dataclasses.fields(cls):
            if f.metadata.get("hidden"):
                continue
            note = notes.get(f.name, "")
            if f.metadata.get("omit_none"):
                note = "*omitted when null*" + (f"; {note}" if note else "")
            if f.metadata.get("flatten") or (cls is metrics.RecoveryEvent and f.name == "detail"):
                note = "*its keys are written into the record itself*" + (f"; {note}" if note else "")
            out.append(f"| `{f.name}` | `{_cell(_type(f))}` | {_cell(note)} |\n")
        if cls is metrics.RecoveryEvent:  # written by its to_json, not a field
            out.append(f"| `mttr_s` | `float` | the sum of {', '.join(metrics.MTTR_PHASES)} |\n")
    return "".join(out)


FILES = {"config-reference.md": config_reference, "events-reference.md": events_reference}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a file differs from the code")
    ap.add_argument("--docs", default=str(DOCS))
    args = ap.parse_args(argv)
    stale = []
    for name, make in FILES.items():
        path, text = Path(args.docs) / name, make()
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"stale: {', '.join(stale)} (run `python -m elasjax.observe.reference`)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
