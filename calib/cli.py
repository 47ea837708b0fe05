"""The `s2moe-calib` command: probe, profile, validate, fit, export, predict, schema.

One module per command; the runtime's error table turns user errors into one line and exit 2.
"""

from __future__ import annotations

from typing import Optional

import typer
from rich.table import Table

from s2moe.runtime.cli.common import out, print_json
from s2moe.runtime.cli import version_option
from s2moe.runtime.cli.errors import cli_errors

from .fit_export import export, fit
from .predict import predict
from .profile_cmd import profile
from .validate_cmd import validate

app = typer.Typer(
    name="s2moe-calib",
    help="Measure a device and write the profile `s2moe run` consumes. Porting = profile + validate.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help text is plain: brackets print as written
)


@app.callback()
def _main(version: bool = version_option("s2moe-calib")) -> None:
    """Measure a device and write the profile `s2moe run` consumes. Porting = profile + validate."""


app.command("profile")(profile)
app.command("validate")(validate)
app.command("fit")(fit)
app.command("export")(export)
app.command("predict")(predict)


@app.command("probe")
def probe_cmd(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Report the block device behind this model file."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
):
    """Describe this machine: CPU, memory, GPUs (NVML), Jetson board, storage behind the model."""
    with cli_errors():
        import os

        from s2moe.runtime.cli.common import resolve_model
        from s2moe.runtime.device import probe
        from s2moe.runtime.errors import UsageError

        path = resolve_model(model) if model else None
        if path is not None and not os.path.exists(path):
            raise UsageError(f"--model {model}: no such file or folder; pass the model file or folder to report the "
                             "storage behind it, or leave --model out")
        facts = probe(path).to_dict()
        if json_out:
            print_json(facts)
            return
        table = Table(title="device", show_header=False)
        for key, value in facts.items():
            table.add_row(key, str(value))
        out.print(table)


@app.command("schema")
def schema_cmd():
    """Print the profile JSON Schema (profiles/schema.json is generated from this)."""
    from s2moe.runtime.profile import schema_json

    import sys

    sys.stdout.write(schema_json())


def main() -> None:
    app()
