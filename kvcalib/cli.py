"""The `kvcalib` command line: a thin layer that parses options and calls the Python API."""

import sys

import click

from kvcalib.errors import KvcalibError
from kvcalib_runtime.errors import KvcalibRuntimeError


class _Group(click.Group):
    """Expected failures print one line and exit 2; anything else keeps its traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (KvcalibError, KvcalibRuntimeError) as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)


@click.group(cls=_Group)
@click.version_option(package_name="kvcalib")
def main():
    """Calibrate, convert and evaluate low-bit KV-cache quantization of LLMs."""


@main.command()
@click.argument("path", required=False)
def inspect(path):
    """Summarize a model (default: smollm2-135m), a profile folder or a converted folder."""
    from kvcalib.inspect import summary

    click.echo(summary(path))
