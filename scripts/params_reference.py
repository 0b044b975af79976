"""Write docs/params.md, the Param reference, from the Param table (include/dflash_regen/settings/params.py SPECS).

    .venv/bin/python scripts/params_reference.py > docs/params.md

tests/architecture/test_docs.py fails when docs/params.md is not what this prints. Defaults a deployment sets
(settings/deployment.py) are shown as their environment variable and the demo's value, so the page does not
depend on the machine it is generated on.
"""

from __future__ import annotations

import json
import sys

from dflash_regen.settings.deployment import _ENV
from dflash_regen.settings.params import SPECS, Spec, range_rule

HEADER = """# Param reference

Generated from the Param table, `SPECS` in
[include/dflash_regen/settings/params.py](../include/dflash_regen/settings/params.py), by
`.venv/bin/python scripts/params_reference.py > docs/params.md`; `tests/architecture/test_docs.py` fails when
this page is not current. Do not edit it by hand.

Every Param is in the trigger form (sections in this order), the REST API's `conf` and the CLI's `--conf`.
Airflow refuses a value outside its range before the run starts, and `RunConfig.from_params`
(include/dflash_regen/settings/run_config.py) checks the same table again. A default marked *deployment*
comes from the environment variable named (include/dflash_regen/settings/deployment.py); the value shown is
the demo's, used when the variable is unset. The *Emulator* section is shown only when the server command is
`emulator`; `node_failure` exists only with several nodes (`DFLASH_NODES`).
"""


def _type(spec: Spec) -> str:
    kinds = spec.type if isinstance(spec.type, tuple) else (spec.type,)
    named = [k for k in kinds if k != "null"]
    return " or ".join(named) + (" (may be empty)" if "null" in kinds else "")


def _default(spec: Spec) -> str:
    # The table's output root is the home of whoever runs it.
    value = "~/dflash-regen" if spec.deployed == "output_root" else spec.default
    shown = (f"`{value}`" if value else "empty") if isinstance(value, str) else f"`{json.dumps(value)}`"
    return f"*deployment* `{_ENV[spec.deployed]}`; demo: {shown}" if spec.deployed else shown


def _allowed(spec: Spec) -> str:
    if spec.enum:
        return "one of " + ", ".join(f"`{v}`" for v in spec.enum)
    if spec.minimum is not None or spec.maximum is not None or spec.exclusive_minimum is not None:
        return range_rule(spec).removeprefix("must be ")
    if spec.rule:
        return spec.rule.removeprefix("must be ")
    if spec.min_length:
        return "not empty"
    return ""


def _cell(text: str) -> str:
    """Text for a table cell: pipes escaped, and `<` so Markdown does not read `<model name>` as a tag."""
    return text.replace("|", "\\|").replace("\n", " ").replace("<", "&lt;")


def render() -> str:
    lines = [HEADER.rstrip()]
    section = None
    for name, spec in SPECS.items():
        if spec.section != section:
            section = spec.section
            lines += ["", f"## {section}", "", "| Param | type | default | allowed | description |",
                      "|---|---|---|---|---|"]
        cells = (f"`{name}`", _type(spec), _default(spec), _allowed(spec),
                 f"**{spec.title}.** {spec.description}")
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
