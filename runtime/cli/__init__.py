"""The `s2moe` command: run, info, convert, bench, serve. One module per command; errors via `errors.cli_errors`."""

from __future__ import annotations

import typer

from . import bench, convert, info, run, serve

app = typer.Typer(
    name="s2moe",
    help="Self-speculative MoE decoding with expert offloading (S²-MoE).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("run")(run.run)
app.command("info")(info.info)
app.command("convert")(convert.convert)
app.command("bench")(bench.bench)
app.command("serve")(serve.serve)


def main() -> None:
    app()
