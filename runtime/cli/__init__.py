"""The `s2moe` command: run, chat, info, convert, bench, serve, vocab. One module per command; errors via `errors.cli_errors`."""

from __future__ import annotations

import typer

from . import bench, chat, convert, info, run, serve, vocab

app = typer.Typer(
    name="s2moe",
    help="Self-speculative MoE decoding with expert offloading (S²-MoE).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help text is plain: brackets such as [[layer, expert]] print as written
)


def version_option(prog: str):
    """An eager --version for a Typer app's callback: the installed distribution's version."""

    def show(value: bool) -> None:
        if value:
            from importlib.metadata import PackageNotFoundError, version

            try:
                v = version("s2moe")
            except PackageNotFoundError:  # run from a source tree without installing
                v = "unknown (not installed)"
            print(f"{prog} {v}")
            raise typer.Exit()

    return typer.Option(False, "--version", callback=show, is_eager=True, help="Print the version and exit.")


@app.callback()
def _main(version: bool = version_option("s2moe")) -> None:
    """Self-speculative MoE decoding with expert offloading (S²-MoE)."""


app.command("run")(run.run)
app.command("chat")(chat.chat)
app.command("info")(info.info)
app.command("convert")(convert.convert)
app.command("bench")(bench.bench)
app.command("serve")(serve.serve)
app.command("vocab")(vocab.vocab)


def main() -> None:
    app()
