"""The `s2moe-calib` command. Measurement commands build on the runtime's own code paths."""

from __future__ import annotations

from typing import Optional

import typer
from rich.table import Table

from s2moe.runtime.cli.common import out, print_json
from s2moe.runtime.cli.errors import cli_errors

app = typer.Typer(
    name="s2moe-calib",
    help="Measure a device and write the profile `s2moe run` consumes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _group() -> None:
    """Measure a device and write the profile `s2moe run` consumes."""


@app.command("probe")
def probe_cmd(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Report the block device behind this model file."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
):
    """Describe this machine: CPU, memory, GPUs (NVML), Jetson board, storage behind the model."""
    with cli_errors():
        from s2moe.runtime.device import probe

        facts = probe(model).to_dict()
        if json_out:
            print_json(facts)
            return
        table = Table(title="device", show_header=False)
        for key, value in facts.items():
            table.add_row(key, str(value))
        out.print(table)


def main() -> None:
    app()
