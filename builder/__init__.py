"""The project's offline builder (see `python -m builder --help`)."""
