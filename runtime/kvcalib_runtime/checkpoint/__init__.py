"""The converted checkpoint: its format (FORMAT.md; `format.read_checkpoint`, the one validator),
what a reader checks of its meaning (`checks`) and the closed-object rule (`closed`)."""
